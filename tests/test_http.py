"""dspark's one HTTP client against real loopback servers that misbehave."""

import time

import pytest

from dspark import http
from hostile import HostileServer, answer, endless, redirect


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
