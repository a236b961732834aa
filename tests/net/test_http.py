"""dspark's one HTTP client against real loopback servers that misbehave."""

import time

import pytest

from dspark.net import http
from tests.harness.hostile import HostileServer, answer, endless, redirect
from tests.harness.hostile_http import bomb_handler, gzip_gzip_bomb, hostile


def test_api_key_is_not_forwarded_on_a_redirect_to_another_host():
    with HostileServer({"/v1/models": answer(b'{"data": []}')}, host="127.0.0.2") as other:
        with HostileServer({"/v1/models": redirect(other.url + "/v1/models")}) as first:
            r = http.request(first.url + "/v1/models", token="s3cret")
            assert r.status == 200
            assert first.seen[0][2].get("Authorization") == "Bearer s3cret"
            assert other.seen and "Authorization" not in other.seen[0][2]


def test_api_key_kept_on_a_redirect_within_the_same_server():
    routes = {"/a": None, "/b": answer(b"{}")}
    with HostileServer(routes) as s:
        routes["/a"] = redirect(s.url + "/b")
        assert http.request(s.url + "/a", token="k").status == 200
        assert [h.get("Authorization") for _, _, h in s.seen] == ["Bearer k", "Bearer k"]


def test_an_endless_answer_is_cut_at_the_body_limit():
    with HostileServer({"/metrics": endless()}) as s:
        t0 = time.monotonic()
        with pytest.raises(http.HTTPFailure, match="larger than"):
            http.request(s.url + "/metrics", timeout=10, max_bytes=1_000_000)
        assert time.monotonic() - t0 < 10


def test_a_trickling_answer_is_cut_at_the_deadline():
    with HostileServer({"/state": endless(b" ", every_s=0.1)}) as s:
        t0 = time.monotonic()
        with pytest.raises(http.HTTPFailure, match="deadline"):
            http.get_json(s.url + "/state", timeout=1.0)
        assert time.monotonic() - t0 < 3


@pytest.mark.parametrize("body", [b"[1, 2]", b'"x"', b"null", b"3"])
def test_get_object_refuses_json_that_is_not_an_object(body):
    with HostileServer({"/state": answer(body)}) as s:
        with pytest.raises(http.HTTPFailure, match="not an object"):
            http.get_object(s.url + "/state")


def test_refused_connection_is_told_apart():
    with HostileServer({}) as s:
        url = s.url
    with pytest.raises(http.HTTPFailure) as e:
        http.request(url + "/x", timeout=2)
    assert e.value.refused and "Connection refused" in str(e.value)


@pytest.mark.parametrize("url", ["ftp://127.0.0.1/x", "http://", "http://[::1/x", "127.0.0.1:8000"])
def test_malformed_url_is_a_failure_not_a_crash(url):
    with pytest.raises(http.HTTPFailure):
        http.request(url, timeout=1)


# Issue 33, items 5 and 6 (every caller, in processes of their own: tests/net/test_http_bomb.py).

def test_requests_ask_for_answers_as_they_are():
    with HostileServer({"/state": answer(b"{}")}) as s:
        http.get_object(s.url + "/state")
        with http.stream(s.url + "/state", data={"x": 1}) as r:
            r.read()
    assert [h.get("Accept-Encoding") for _, _, h in s.seen] == ["identity", "identity"]


@pytest.mark.parametrize("encoding", ["gzip", "gzip, gzip", "deflate", "br", "zstd", "x-unknown", "identity, gzip"])
def test_an_encoded_answer_is_refused_unread(encoding):
    body = gzip_gzip_bomb(64)  # 64 MiB once decoded, past every body cap
    with HostileServer({"/state": bomb_handler(body, encoding)}) as s:
        with pytest.raises(http.HTTPFailure, match=f"Content-Encoding '{encoding}', refused unread"):
            http.get_json(s.url + "/state", timeout=5)


def test_an_identity_answer_is_read():
    with HostileServer({"/state": bomb_handler(b'{"state": "serving"}', "identity")}) as s:
        assert http.get_object(s.url + "/state") == {"state": "serving"}


@pytest.mark.parametrize("post", [False, True])
def test_a_head_sent_a_byte_at_a_time_is_cut_at_the_deadline(post):
    """One byte every 0.5 s never lets a 2 s read timeout pass; the deadline covers the head."""
    with hostile("trickle", b"", ("/state",)) as (s,):
        t0 = time.monotonic()
        with pytest.raises(http.HTTPFailure, match="no complete answer within its 1.5 s deadline"):
            with http.stream(s.url + "/state", data={"x": 1} if post else None, timeout=2.0, deadline_s=1.5) as r:
                r.read()
        took = time.monotonic() - t0
    assert 1.4 <= took < 1.5 + 5, took


def test_a_redirect_spends_the_same_deadline():
    with hostile("trickle", b"", ("/slow",)) as (slow,):
        with HostileServer({"/a": redirect(slow.url + "/slow")}) as first:
            t0 = time.monotonic()
            with pytest.raises(http.HTTPFailure, match="deadline"):
                http.request(first.url + "/a", timeout=1.0)
            assert time.monotonic() - t0 < 1.0 + 5
