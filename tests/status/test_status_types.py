"""`dspark status` when an agent answers a node state whose other fields have the wrong type
(issue 33, item 14): the node's row is printed with what is known and `?` for the field that
makes no sense, the command ends as usual, never with a traceback."""

from __future__ import annotations

import json

import pytest

from tests.harness.dspark_cli import invoke_dspark
from tests.harness.hostile import HostileServer, answer
from tests.status.test_status_hostile import cluster_for, port

GOOD = {"state": "serving", "node": "w", "rank": 1, "detail": "vLLM serving", "runtime_line": "v0.28.0",
        "vllm_pid": 4242, "vllm_version": "0.28.0", "restarts": 0, "uptime_s": 12.0}

# The four of the issue first (uptime_s "x", detail 12345, runtime_line a list, all at once).
BAD = [
    {"uptime_s": "x"},
    {"detail": 12345},
    {"runtime_line": ["v0.28.0"]},
    {"uptime_s": "x", "detail": 12345, "runtime_line": ["v0.28.0"]},
    {"uptime_s": [1]},
    {"uptime_s": {"s": 1}},
    {"uptime_s": True},
    {"detail": ["a", "b"]},
    {"detail": None},
    {"runtime_line": {"line": 1}},
    {"runtime_line": 7},
    {"vllm_pid": {"pid": 1}},
    {"vllm_pid": "12"},
    {"restarts": "x"},
    {"restarts": -1.5},
    {"vllm_version": ["0.28.0"]},
    {"liveness": "x"},
    {"liveness": {"ok": "yes", "proof": "progress", "proof_at": "x", "error": 5}},
    {"liveness": {"ok": False, "proof": ["progress"], "proof_at": [1], "error": {"e": 1}}},
    {"line_switch": "x"},
    {"line_switch": {"from": [1], "to": {"a": 2}, "id": None, "rollback": "no"}},
]


def row(out: str, name: str) -> list[str]:
    return next(line.split() for line in out.splitlines() if line.split()[:1] == [name])


@pytest.mark.parametrize("bad", BAD, ids=[json.dumps(b) for b in BAD])
def test_status_prints_a_row_for_wrong_typed_agent_fields(tmp_path, bad):
    head = dict(GOOD, node="h", rank=0)
    worker = dict(GOOD, **bad)
    api = {"/health": answer(b""), "/version": answer(b'{"version": "0.28.0"}')}
    with HostileServer({"/state": answer(json.dumps(head).encode())}) as h, \
            HostileServer({"/state": answer(json.dumps(worker).encode())}, host="127.0.0.2") as w, \
            HostileServer(api) as a:
        path = cluster_for(tmp_path, head_port=port(h), worker_port=port(w), api_port=port(a))
        r = invoke_dspark("status", "--config", str(path))  # an exception here would be the traceback
        j = invoke_dspark("status", "--config", str(path), "--json")
    assert r.returncode == 0 and j.returncode == 0, r.stderr + j.stderr
    assert "pair: SERVING" in r.stdout
    cells = row(r.stdout, "w")
    assert cells[:3] == ["w", "1", "serving"], r.stdout
    shown = {"runtime_line": cells[3], "vllm_pid": cells[4], "restarts": cells[5], "uptime_s": cells[6]}
    nested = ("liveness", "line_switch")  # objects whose own fields are checked where they are shown
    wrong = sorted(k for k, v in bad.items()
                   if v is not None and not (k in nested and isinstance(v, dict)))  # null: not known
    for field, cell in shown.items():
        if field in wrong:
            assert cell == "?", (field, r.stdout)
    if "detail" in wrong:
        assert cells[7:] == ["?"], r.stdout
    if "uptime_s" not in bad:
        assert shown["uptime_s"] == "12s"
    if isinstance(bad.get("liveness"), dict):
        assert "liveness (w): NOT ALIVE (?); no proof of life yet" in r.stdout, r.stdout
    if isinstance(bad.get("line_switch"), dict):
        assert "runtime line: switching ? -> ? (?; dspark switch --history on the head)" in r.stdout, r.stdout
    assert row(r.stdout, "h")[:8] == ["h", "0", "serving", "v0.28.0", "4242", "0", "12s", "vLLM"], r.stdout
    snap = json.loads(j.stdout)
    assert snap["serving"] is True and [n["state"] for n in snap["nodes"]] == ["serving", "serving"]
    h_snap, w_snap = snap["nodes"]
    assert h_snap["invalid"] == [] and w_snap["invalid"] == wrong  # and their values are left out:
    assert all(w_snap[k] is None for k in wrong)
