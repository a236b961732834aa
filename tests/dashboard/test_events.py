"""The event timeline: each supervisor keeps a bounded ring of its events in its state
(dspark.node.states.NodeState.events, served by its agent), and the dashboard's collector merges
the nodes' rings. Proved on the NodeState itself, then through real `dspark serve` processes with
the stand-in vLLM: a liveness loss, the restart after it, a drain and the clean stop, read from
the agent by the real collector."""

from __future__ import annotations

import signal
import time
from pathlib import Path

from dspark.config.validate import load
from dspark.dashboard import collector as C
from dspark.node import states as S
from dspark.node.policy import EXIT_DIED, EXIT_OK
from tests.harness.dashboard import MetricsStandIn, validate_snapshot
from tests.harness.standin import write_cluster  # noqa: E402


def kinds(events) -> list[str]:
    return [e["kind"] for e in events]


# ------------------------------------------------------------------ the ring

def test_state_changes_become_events():
    st = S.NodeState(node="h", rank=0, role="head", runtime_line="v0.28.0")
    for state, detail in [(S.STARTING, "rank 0 of 2"), (S.STARTING, "rank 0 of 2"),
                          (S.RENDEZVOUS, "waiting for w"), (S.RENDEZVOUS, "waiting for the worker(s)"),
                          (S.LOADING, "loading the model"), (S.SERVING, "API on http://x"),
                          (S.STOPPING, "received SIGTERM: draining the requests in flight (up to 60 s)"),
                          (S.STOPPED, "vLLM drained its requests and stopped after SIGTERM")]:
        st.record_state(state, detail)
        st.state, st.detail = state, detail
    assert kinds(st.events) == ["start", "stage", "stage", "serving", "drain", "stopped"]
    assert st.events[0]["detail"] == "rank 0 of 2; runtime line v0.28.0"
    assert st.events[1]["detail"] == "rendezvous: waiting for w"
    assert all(a["at"] <= b["at"] for a, b in zip(st.events, st.events[1:], strict=False))
    assert S.event_kind(S.STARTING, "x", restarts=2) == "restart"
    assert S.event_kind(S.STARTING, "x", restarts=2, resumed=True) == "switch"
    assert S.event_kind(S.STARTING, "backoff: 3 failed runs in a row, next start in 20 s") == "backoff"
    assert S.event_kind(S.STOPPING, "received SIGTERM") == "stopping"
    assert S.event_kind(S.FAILED, "liveness lost: x") == "failed"


def test_the_ring_is_bounded_and_details_capped():
    st = S.NodeState(node="h", rank=0, role="head")
    for i in range(3 * S.EVENTS_MAX):
        st.record("stage", f"{i} " + "x" * 1000)
    assert len(st.events) == S.EVENTS_MAX
    assert st.events[0]["detail"].startswith(f"{2 * S.EVENTS_MAX} ")
    assert max(len(e["detail"]) for e in st.events) == S.EVENT_DETAIL_MAX
    assert st.snapshot()["events"] == st.events


def test_liveness_verdicts_and_switches_are_recorded_when_they_change():
    st = S.NodeState(node="h", rank=0, role="head")
    now = time.time()
    st.liveness = S.Liveness(ok=True, at=now, proof="probe", proof_at=now, proof_detail="1-token completion in 0.02 s")
    st.liveness = S.Liveness(ok=True, at=now + 1)  # the same verdict: nothing new
    st.liveness = S.Liveness(ok=False, at=now + 2, error="completion failed: HTTP 500")
    st.liveness = S.Liveness(ok=True, at=now + 3)
    assert [e["detail"] for e in st.events] == ["alive (probe: 1-token completion in 0.02 s)",
                                                "not alive: completion failed: HTTP 500", "alive"]
    assert [e["at"] for e in st.events] == [round(now + d, 3) for d in (0, 2, 3)]  # the rounds' own times
    sw = {"id": "s1", "from": "v0.28.0", "to": "v0.32.0", "rollback": False, "at": now}
    st.line_switch = sw
    st.line_switch = dict(sw)  # re-read, the same switch
    st.line_switch = None
    st.line_switch = {**sw, "id": "s1-rollback", "from": "v0.32.0", "to": "v0.28.0", "rollback": True}
    assert [e["detail"] for e in st.events[3:]] == [
        "runtime-line switch v0.28.0 → v0.32.0 under way (s1)", "runtime-line switch v0.28.0 → v0.32.0 ended (s1)",
        "runtime-line rollback v0.32.0 → v0.28.0 under way (s1-rollback)"]
    assert kinds(st.events[3:]) == ["switch"] * 3


def test_the_collector_merges_rings_once_each_and_in_time_order(metrics_stand_in):
    """Two agents whose rings interleave in time; every poll serves the whole ring again."""
    from dspark.node import agent as A

    t0 = time.time() - 100
    head, worker = S.NodeState(node="a", rank=0, role="head"), S.NodeState(node="b", rank=1, role="worker")
    for i, (st, kind) in enumerate([(head, "start"), (worker, "start"), (head, "serving"), (worker, "serving")]):
        st.record(kind, at=t0 + i)
    agents = {st.node: A.Agent("127.0.0.1", 0, st.snapshot).start() for st in (head, worker)}
    try:
        nodes = tuple(C.NodeTarget(n, i, "head" if i == 0 else "worker", f"http://127.0.0.1:{agents[n].port}")
                      for i, n in enumerate(("a", "b")))
        metrics_stand_in.text = (Path(__file__).parent / "fixtures" / "vllm_metrics_a.txt").read_text()
        col = C.Collector(C.Targets(metrics_stand_in.url, nodes), timeout_s=2.0)
        col.tick()
        head.record("drain", "received SIGTERM", at=t0 + 10)
        head.record("stopped", "", at=t0 + 10)  # the same moment, another event
        worker.record("liveness", "x", at=t0 + 5)
        snap = col.tick()
        col.tick()
        validate_snapshot(snap)
        assert [(e["node"], e["kind"]) for e in snap["events"]] == [
            ("a", "start"), ("b", "start"), ("a", "serving"), ("b", "serving"), ("b", "liveness"),
            ("a", "drain"), ("a", "stopped")]
        assert len(col.timeline.events) == 7 and {e["by"] for e in snap["events"]} == {"node"}
        agents["b"].stop()  # gone without a word: the dashboard says so in the timeline, once
        col.tick()
        snap = col.tick()
        validate_snapshot(snap)
        lost = [e for e in snap["events"] if e["kind"] == "lost"]
        assert len(lost) == 1 and lost[0]["node"] == "b" and lost[0]["by"] == "dashboard"
    finally:
        for a in agents.values():
            try:
                a.stop()
            except OSError:
                pass


# ------------------------------------------------------------------ real supervisors

def poll_until(col: C.Collector, done, timeout: float, what: str) -> dict:
    """Collector rounds every 0.2 s until done(snapshot); bounded."""
    deadline = time.monotonic() + timeout
    while True:
        snap = col.tick()
        if done(snap):
            return snap
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not seen in {timeout} s; events: {snap['events']}")
        time.sleep(0.2)


def test_a_real_supervisors_timeline(tmp_path, serve):
    """Run 1: serving, then its completions fail (liveness lost, exit). Run 2 on the same state
    directory: a restart, serving, then SIGTERM with a drain: drained, stopped. The collector,
    polling the agent throughout, holds both runs' events (the first run's ring went with it)."""
    cluster_file = write_cluster(tmp_path, drain_s=2.0)
    targets = C.Targets.from_cluster(load(cluster_file))
    metrics = MetricsStandIn("")  # vLLM's figures are not what this test reads
    col = C.Collector(dataclass_replace(targets, api_url=metrics.url), timeout_s=1.0)
    try:
        s1 = serve(cluster_file, "h", STANDIN_FAIL_AFTER=4)
        poll_until(col, lambda s: "serving" in kinds(s["events"]), 45, "run 1 serving")
        assert s1.wait(timeout=60) == EXIT_DIED
        s1.close()
        Path(s1.sock_path).unlink()  # the next run binds its notify socket at the same path
        s2 = serve(cluster_file, "h")
        poll_until(col, lambda s: kinds(s["events"]).count("serving") == 2, 45, "run 2 serving")
        s2.proc.send_signal(signal.SIGTERM)
        snap = poll_until(col, lambda s: "stopped" in kinds(s["events"]), 45, "the clean stop")
        assert s2.wait(timeout=60) == EXIT_OK
    finally:
        metrics.close()
    validate_snapshot(snap)
    ev = snap["events"]
    k = kinds(ev)
    run1, run2 = k[:k.index("restart")], k[k.index("restart"):]
    assert run1[0] == "start" and "serving" in run1 and "liveness" in run1, k
    assert next(e for e in ev if e["kind"] == "liveness")["detail"].startswith("alive"), ev
    # A node that fails exits at once, its agent with it: its last words ("failed: liveness lost")
    # are seen only if a poll falls in between; otherwise the dashboard records the loss itself.
    end = ev[len(run1) - 1]
    assert (end["kind"], end["by"]) in (("failed", "node"), ("lost", "dashboard")), ev
    assert "liveness lost" in end["detail"] if end["kind"] == "failed" else "refused" in end["detail"], end
    restart = next(e for e in ev if e["kind"] == "restart")
    assert restart["detail"].startswith("restart 1; rank 0 of 1"), restart
    assert "serving" in run2 and run2[-2:] == ["drain", "stopped"], k
    assert "draining" in ev[-2]["detail"] and {e["node"] for e in ev} == {"h"}
    assert "lost" not in run2  # a clean stop is not a loss
    assert all(a["at"] <= b["at"] for a, b in zip(ev, ev[1:], strict=False))


def dataclass_replace(obj, **kw):
    import dataclasses

    return dataclasses.replace(obj, **kw)
