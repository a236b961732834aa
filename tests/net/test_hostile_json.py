"""Hostile JSON from a peer: nested past the recursion limit, nested deeper
than any real answer, or larger than any agent's /state. Through the real callers: the agent
client, `dspark status`, `dspark wait-worker`, the head's supervisor waiting for its worker,
and the dashboard's collector. Each sees an unreachable node, never a traceback."""

from __future__ import annotations

import json
import time

import pytest

from dspark.config import validate as C
from dspark.dashboard import collector as DC
from dspark.node.agent_client import fetch_state
from dspark.node.policy import EXIT_NEVER_READY
from tests.harness.dspark_cli import invoke_dspark
from tests.harness.hostile import HostileServer, answer, send
from tests.harness.standin import write_cluster
from tests.status.test_status_hostile import cluster_for, port


def nested(depth: int, inner: bytes = b"1") -> bytes:
    return b'{"state": "rendezvous", "x": ' + b"[" * depth + inner + b"]" * depth + b"}"


HOSTILE = {
    "deep-list": b"[" * 200_000,  # past the recursion limit: RecursionError before the fix
    "deep-object": b'{"a": ' * 50_000 + b"1" + b"}" * 50_000,
    "deep-inside-a-state": nested(500),  # parses, but deeper than any real answer
    "large-state": json.dumps({"state": "rendezvous", "pad": "x" * (3 * 1024 * 1024)}).encode(),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_fetch_state_refuses_hostile_json_and_never_raises(name):
    with HostileServer({"/state": answer(HOSTILE[name])}) as peer:
        t0 = time.monotonic()
        a = fetch_state(peer.url, timeout=5.0)
        took = time.monotonic() - t0
    assert a.state is None and not a.refused, a
    assert "nested" in a.error or "larger than" in a.error, a.error
    assert took < 30, took


@pytest.mark.parametrize("name", ["deep-list", "deep-inside-a-state"])
def test_status_and_wait_worker_with_hostile_json(tmp_path, name):
    routes = {"/state": answer(HOSTILE[name]), "/version": answer(HOSTILE[name]), "/health": answer(b"")}
    with HostileServer(routes, host="127.0.0.2") as worker, HostileServer(routes) as head, \
            HostileServer(routes) as api:
        path = cluster_for(tmp_path, port(worker), port(head), port(api))
        r = invoke_dspark("status", "--config", str(path), "--json")
        assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
        snap = json.loads(r.stdout)
        assert [n["state"] for n in snap["nodes"]] == ["unreachable", "unreachable"]
        assert snap["api"].get("version") is None
        r = invoke_dspark("wait-worker", "--config", str(path), "--timeout", "1")
        assert r.returncode == 1 and "Traceback" not in r.stderr and "is unreachable" in r.stderr, r.stderr[-3000:]


def test_a_head_waiting_for_a_hostile_worker_keeps_waiting_quietly_then_pairs(tmp_path, serve):
    """Before the fix the head's peer poll died with RecursionError and was restarted at once:
    thousands of tracebacks a few seconds. Now the worker is just not in the rendezvous yet."""
    cluster = write_cluster(tmp_path, nodes=2, worker_wait_timeout_s=60.0)
    worker = C.load(cluster).node("w")
    reply = {"body": HOSTILE["deep-list"]}
    good = json.dumps({"state": "rendezvous", "node": "w", "rank": 1}).encode()
    routes = {"/state": lambda h: send(h, 200, reply["body"])}
    with HostileServer(routes, host=worker.address, port=worker.agent_port) as fake_worker:
        h = serve(cluster, "h")  # the head's real supervisor, with the stand-in vLLM
        h.read(until="waiting for w", timeout=20)
        time.sleep(4)  # many peer polls against the hostile answer
        assert sum(1 for s in fake_worker.seen if s[1] == "/state") > 1
        assert h.proc.poll() is None and h.state()["state"] == "rendezvous"
        reply["body"] = nested(200)
        time.sleep(2)
        assert h.proc.poll() is None and h.state()["state"] == "rendezvous"
        reply["body"] = good  # now a real worker in the rendezvous: the head starts vLLM
        h.read(until="READY=1", timeout=30)
        h.proc.terminate()
        h.proc.wait(timeout=30)
        out = h.proc.stdout.read()
    assert "Traceback" not in out and "RecursionError" not in out, out[-3000:]
    assert len(out) < 200_000, len(out)  # a few lines, not a log flood


def test_a_head_whose_worker_only_answers_hostile_json_gives_up_as_never_ready(tmp_path, serve):
    cluster = write_cluster(tmp_path, nodes=2, worker_wait_timeout_s=3.0)
    worker = C.load(cluster).node("w")
    with HostileServer({"/state": answer(HOSTILE["deep-object"])}, host=worker.address, port=worker.agent_port):
        h = serve(cluster, "h")
        rc = h.wait(timeout=60)
        out = h.proc.stdout.read()
    assert rc == EXIT_NEVER_READY, (rc, out[-3000:])
    assert "Traceback" not in out and "w at http" in out and "is unreachable" in out, out[-3000:]


def test_the_dashboard_collector_keeps_polling_hostile_peers(tmp_path):
    routes = {"/state": answer(HOSTILE["deep-list"]), "/version": answer(HOSTILE["deep-object"]),
              "/metrics": answer(b"", ctype="text/plain")}
    with HostileServer(routes, host="127.0.0.2") as worker, HostileServer(routes) as head, \
            HostileServer(routes) as api:
        cluster = C.load(cluster_for(tmp_path, port(worker), port(head), port(api)))
        col = DC.Collector(DC.Targets.from_cluster(cluster), interval_s=0.2, timeout_s=5.0).start()
        try:
            deadline = time.monotonic() + 60
            while col.snapshot().get("round", 0) < 5 and time.monotonic() < deadline:
                time.sleep(0.2)
            snap = col.snapshot()
        finally:
            col.stop()
    assert snap.get("round", 0) >= 5 and "collector_error" not in snap, snap
    assert [n["state"] for n in snap["nodes"]] == ["unreachable", "unreachable"], snap["nodes"]
