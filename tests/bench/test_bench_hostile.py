"""bench against misbehaving servers and malformed reports: a clear line, never a traceback."""

from __future__ import annotations

import json
import time

import pytest

from dspark.bench.report import paths
from tests.bench.test_bench_units import make_report
from tests.harness.dspark_cli import invoke_dspark
from tests.harness.hostile import HostileServer, answer, endless, send
from tests.harness.pair import run_dspark

METRICS_OK = b"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 0.0\n"
MODELS = json.dumps({"data": [{"id": "m", "max_model_len": 4096}]}).encode()


def sse(*chunks: bytes):
    def fn(h):
        body = b"".join(b"data: " + c + b"\n\n" for c in chunks)
        send(h, 200, body, "text/event-stream")
    return fn


def good_chunk(i: int) -> bytes:
    return json.dumps({"choices": [{"index": 0, "text": str(i)}]}).encode()


def routes(**over):
    r = {"/v1/models": answer(MODELS), "/version": answer(b'{"version": "0.28.0"}'),
         "/metrics": answer(METRICS_OK, ctype="text/plain"),
         "/v1/completions": sse(*[good_chunk(i) for i in range(4)],
                                b'{"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 4}}', b"[DONE]")}
    r.update(over)
    return r


def decode(url: str, tmp_path, *extra: str, timeout: float = 60):
    return run_dspark("bench", "decode", "--url", url, "--concurrency", "1", "--output-len", "4",
                      "--input-len", "4", "-o", str(tmp_path), "-q", "--request-timeout", "5", *extra,
                      timeout=timeout)


def test_decode_against_a_well_behaved_stand_in_works(tmp_path):
    with HostileServer(routes()) as s:
        r = decode(s.url, tmp_path)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("completions, expected", [
    (sse(b"[1, 2]", b"[DONE]"), "not a JSON object"),
    (sse(b"null", b"[DONE]"), "not a JSON object"),
    (sse(good_chunk(0), b'{"choices": [], "usage": [1]}', b"[DONE]"), "usage is not a JSON object"),
    (sse(good_chunk(0), b'{"choices": [], "usage": {"completion_tokens": "many"}}', b"[DONE]"),
     "not a token count"),
    (sse(b'{"choices": {"a": 1}}', b"[DONE]"), "choices is not a list"),
    (sse(*[good_chunk(i) for i in range(50)], b"[DONE]"), "ignores max_tokens"),
    (endless(b"data: " + good_chunk(0) + b"\n\n", every_s=0.01, ctype="text/event-stream"), "ignores max_tokens"),
    (endless(b": keep-alive\n\n", every_s=0.05, ctype="text/event-stream"), "max_tokens"),
    (endless(b"x" * 65536, ctype="text/event-stream"), "longer than"),
])
def test_decode_against_a_misbehaving_stream(tmp_path, completions, expected):
    with HostileServer(routes(**{"/v1/completions": completions})) as s:
        t0 = time.monotonic()
        r = decode(s.url, tmp_path)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert expected in r.stderr
    assert time.monotonic() - t0 < 30


def test_decode_with_a_stream_that_outlives_its_deadline(tmp_path):
    """A server that keeps a stream open, sending nothing useful slowly, ends at --request-timeout."""
    slow = endless(b"\n", every_s=0.5, ctype="text/event-stream")
    with HostileServer(routes(**{"/v1/completions": slow})) as s:
        t0 = time.monotonic()
        r = decode(s.url, tmp_path, "--request-timeout", "2")
    assert r.returncode == 1 and "Traceback" not in r.stderr and "deadline" in r.stderr, r.stderr
    assert time.monotonic() - t0 < 20


@pytest.mark.parametrize("path, body", [
    ("/metrics", b"garbage { not prometheus \x00\n"),
    ("/v1/models", b"[1, 2]"),
    ("/v1/models", b'{"data": [1, null, "x"]}'),
    ("/v1/models", b'{"data": "x"}'),
])
def test_decode_against_garbage_answers(tmp_path, path, body):
    with HostileServer(routes(**{path: answer(body)})) as s:
        r = decode(s.url, tmp_path)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr


@pytest.mark.parametrize("url", ["http://[::1", "http://127.0.0.1:99999", "http://"])
def test_decode_with_a_malformed_url(tmp_path, url):
    r = decode(url, tmp_path)
    assert r.returncode in (1, 2) and "Traceback" not in r.stderr, r.stderr


def test_huge_concurrency_is_refused_at_once(tmp_path):
    t0 = time.monotonic()
    r = run_dspark("bench", "decode", "--url", "http://127.0.0.1:9", "--concurrency", "100000000",
                   "-o", str(tmp_path), timeout=30)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "1024" in r.stderr
    assert time.monotonic() - t0 < 20


# ------------------------------------------------------------------------------ file names
def test_report_files_never_collide():
    labels = ["v0.28.0", "v0.28.1", "v0.28", "a b", "a_b", "a/b", "run", "x.json"]
    names = {paths("out", "decode", label).json for label in labels}
    assert len(names) == len(labels)
    assert paths("out", "decode", "v0.28.0").json.name == "decode-v0.28.0.json"
    assert paths("out", "decode", "v0.28.0").markdown.name == "decode-v0.28.0.md"


# ------------------------------------------------------------------------------ compare
def _pair(tmp_path, mutate_a=None):
    a, b = make_report(label="before", ttft=0.2).to_dict(), make_report(label="after", ttft=0.1).to_dict()
    if mutate_a:
        mutate_a(a)
    pa, pb = tmp_path / "a.json", tmp_path / "b.json"
    pa.write_text(json.dumps(a))
    pb.write_text(json.dumps(b))
    return pa, pb


def _set(path, value):
    def fn(d):
        cur = d
        for k in path[:-1]:
            cur = cur[k]
        cur[path[-1]] = value
    return fn


BAD_FIELDS = [
    (("label",), 5), (("label",), None), (("server",), "x"), (("server",), [1]), (("params",), [1]),
    (("params",), None), (("planned_prompts",), "abc"), (("planned_prompts",), [1, 2]),
    (("prompt_set_sha256",), 7), (("trials",), {"a": 1}), (("trials",), [1]), (("summary",), "x"),
    (("summary",), [None]), (("summary", 0, "length"), "64"), (("summary", 0, "ttft_s"), "fast"),
    (("summary", 0, "ttft_s"), [1]), (("summary", 0, "trials"), 2.5), (("summary", 0, "length"), True),
    (("trials", 0, "ttft_s"), {"x": 1}), (("complete",), "yes"), (("started_at",), 3),
    (("summary", 0, "prefix_cache_hit_trials"), "1"), (("summary", 0, "client_input_tok_s"), float("nan")),
    (("summary", 0, "ttft_s"), float("inf")), (("schema_version",), 0), (("schema_version",), True),
    (("schema_version",), "1"), (("schema_version",), -3), (("summary", 0), {}),
]


@pytest.mark.parametrize("path, value", BAD_FIELDS, ids=[f"{'.'.join(map(str, p))}={v!r}" for p, v in BAD_FIELDS])
def test_compare_refuses_wrongly_typed_reports(tmp_path, path, value):
    pa, pb = _pair(tmp_path, _set(path, value))
    r = invoke_dspark("bench", "compare", str(pa), str(pb))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "bench compare:" in r.stderr and str(pa) in r.stderr
    assert "nan%" not in r.stdout


@pytest.mark.parametrize("path, value, says", [
    (("summary", 0, "ttft_s"), float("nan"), "ttft_s = NaN is not a finite number or null"),
    (("summary", 0, "length"), True, "length = true is not an integer"),
    (("planned_prompts",), [1, 2], "planned_prompts = [1, 2] is not a list of strings"),
    (("server",), [1], "server = [1] is not an object"),
])
def test_a_wrongly_typed_field_is_named_with_its_json_type(tmp_path, path, value, says):
    """The report checker (dspark.config.typecheck, shared with the cluster file) speaks JSON here."""
    pa, pb = _pair(tmp_path, _set(path, value))
    r = invoke_dspark("bench", "compare", str(pa), str(pb))
    assert r.returncode == 2 and f"malformed report: {says}" in r.stderr, r.stderr


def test_compare_labels_cannot_inject_markdown(tmp_path):
    pa, pb = _pair(tmp_path, _set(("label",), "x | evil |\n# heading [link](http://e) <img src=x>"))
    r = invoke_dspark("bench", "compare", str(pa), str(pb))
    assert r.returncode == 0, r.stderr
    header = next(line for line in r.stdout.splitlines() if line.startswith("| length") or line.startswith("| input"))
    assert header.count(" | ") == 6 and "\\|" in header  # still seven cells: the label's '|' is escaped
    assert not any(line.startswith("# heading") for line in r.stdout.splitlines())
    assert "\\<img" in r.stdout and "\\[link\\]" in r.stdout
    assert "<img" not in r.stdout.replace("\\<img", "") and "[link]" not in r.stdout


def test_non_finite_figures_never_print_as_nan():
    from dspark.bench import compare
    from dspark.bench.report import fmt, ms

    nan, inf = float("nan"), float("inf")
    assert compare.gain(nan, 1.0, True) is None and compare.gain(1.0, inf, False) is None
    assert fmt(nan) == fmt(inf) == ms(nan) == "n/a"
