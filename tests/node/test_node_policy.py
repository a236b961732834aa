"""The node policy (dspark.node.policy) on its own: a state machine driven by fake probe
results, fake peer answers and a fake clock, no process and no socket. The same policy runs
in the real supervisor in test_supervisor.py, test_supervisor_signals.py and the pair tests."""

import signal

import pytest

from dspark.node import states as S
from dspark.node.agent_client import AgentAnswer, is_lost
from dspark.node.events import Events, Limits, Peer, ReadyProbe, Round
from dspark.node.liveness import LivenessJudge, Progress, Verdict
from dspark.node.policy import BACKOFF_STABLE_S, EXIT_DIED, EXIT_NEVER_READY, EXIT_OK, NodePolicy

API = "http://127.0.0.1:8000"


def limits(**kw) -> Limits:
    return Limits(**{"ready_timeout_s": 100.0, "liveness_interval_s": 5.0, "head_lost_s": 10.0,
                     "rendezvous_timeout_s": 50.0, "worker_wait_timeout_s": 30.0, **kw})


def policy(is_head=True, peers=(), watchdog_s=None, **kw) -> NodePolicy:
    judge = LivenessJudge(stall_s=30.0, probe_failures=2, fresh_s=6.0)
    return NodePolicy(is_head=is_head, limits=limits(**kw.pop("limits", {})), judge=judge, peers=list(peers),
                      api_url=API, watchdog_s=watchdog_s, **kw)


def kinds(actions) -> list[str]:
    return [a.kind for a in actions]


def state_of(actions):
    shown = [(a.state, a.detail) for a in actions if a.kind == "state"]
    return shown[-1] if shown else None


def exit_of(actions):
    return next((a for a in actions if a.kind == "exit"), None)


def good_probe(now: float) -> ReadyProbe:
    return ReadyProbe(True, S.Liveness(ok=True, at=now, latency_s=0.05),
                      Progress(running=0, waiting=0, work=2), "0.28.0")


def worker_peer():
    return Peer("w", "http://127.0.0.2:8890", is_head=False)


def head_peer():
    return Peer("h", "http://127.0.0.1:8890", is_head=True)


def agent(state: str, started_at: float = 1.0) -> AgentAnswer:
    return AgentAnswer({"state": state, "started_at": started_at})


def serving_head(t: float = 0.0, **kw) -> NodePolicy:
    p = policy(**kw)
    assert kinds(p.start(t)) == ["start_vllm"]
    p.step(t + 0.1, Events(stage="warming"))
    out = p.step(t + 0.2, Events(stage="warming", ready_probe=good_probe(t + 0.2)))
    assert p.ready and "ready" in kinds(out)
    return p


# ------------------------------------------------------------------ readiness
def test_the_head_is_ready_only_after_health_and_a_real_completion():
    p = policy()
    assert kinds(p.start(0.0)) == ["start_vllm"]
    out = p.step(0.05, Events(stage="starting"))
    assert "ready_probe" in kinds(out)                      # the probe runs in the background
    out = p.step(1.0, Events(stage="loading", ready_probe=ReadyProbe(False)))
    assert state_of(out) == ("loading", "loading the model") and not p.ready
    failed = ReadyProbe(True, S.Liveness(ok=False, at=1.1, error="completion: HTTP 503"))
    out = p.step(1.2, Events(stage="warming", ready_probe=failed))
    assert "record_probe" in kinds(out) and "ready" not in kinds(out) and p.failed_probe.error
    out = p.step(2.0, Events(stage="warming", ready_probe=good_probe(2.0)))
    assert state_of(out) == (S.SERVING, f"API on {API}")
    ready = next(a for a in out if a.kind == "ready")
    assert ready.detail == f"serving: API on {API}" and p.version == "0.28.0"
    assert p.judge.proof.kind == "probe"


def test_the_head_polls_health_every_tenth_of_a_second_not_every_tick():
    p = policy()
    p.start(0.0)
    assert "ready_probe" in kinds(p.step(0.0, Events()))
    assert "ready_probe" not in kinds(p.step(0.05, Events()))
    assert "ready_probe" in kinds(p.step(0.11, Events()))


def test_a_worker_is_ready_once_vllm_is_in_the_rendezvous():
    p = policy(is_head=False, peers=[head_peer()])
    p.start(0.0)
    assert "ready" not in kinds(p.step(0.5, Events(stage="starting")))
    out = p.step(1.0, Events(stage="rendezvous"))
    assert "ready" in kinds(out) and state_of(out) == ("rendezvous", "vLLM is in the rendezvous")
    # ... and serving once its head serves.
    out = p.step(2.5, Events(stage="loading", peers={"h": agent(S.SERVING)}))
    assert state_of(out) == (S.SERVING, "pair serving with h") and p.paired


def test_never_ready_within_ready_timeout_stops_vllm_with_exit_3():
    p = policy(limits={"ready_timeout_s": 10.0})
    p.start(0.0)
    assert exit_of(p.step(9.9, Events(stage="warming"))) is None
    out = p.step(10.1, Events(stage="warming"))
    assert kinds(out) == ["state", "stop", "exit"] and exit_of(out).code == EXIT_NEVER_READY
    assert "ready_timeout_s" in state_of(out)[1]


@pytest.mark.parametrize("ready,code", [(False, EXIT_NEVER_READY), (True, EXIT_DIED)])
def test_vllm_exiting_is_exit_3_before_ready_and_4_after(ready, code):
    p = serving_head() if ready else policy()
    if not ready:
        p.start(0.0)
    out = p.step(50.0, Events(vllm_exit=1))
    assert exit_of(out).code == code and "stop" not in kinds(out)
    assert ("while serving" if ready else "before becoming ready") in state_of(out)[1]


def test_start_timeout_is_extended_while_loading():
    p = policy()
    p.start(0.0)
    extends = [t for t in range(0, 100) if "extend" in kinds(p.step(float(t), Events(stage="loading")))]
    assert extends == [0, 31, 62, 93]


# ------------------------------------------------------------------ liveness and the watchdog
def test_liveness_rounds_every_interval_and_the_watchdog_only_while_fed():
    p = serving_head(watchdog_s=2.0)
    rounds = [t for t in range(1, 21) if "liveness_round" in kinds(p.step(float(t), Events()))]
    assert rounds == [6, 11, 16]  # the ready probe at 0.2 counts as the first round
    # The ready probe at 0.2 fed the judge (fresh for 6 s): a ping with READY, at 3 and 5; none
    # after 6.2 without a new round that finds the engine alive.
    p2 = serving_head(watchdog_s=2.0)
    assert p2.last_dog == 0.2
    pings = [t for t in range(1, 12) if "watchdog" in kinds(p2.step(float(t), Events()))]
    assert pings == [3, 5]


def test_a_dead_verdict_stops_vllm_with_exit_4():
    p = serving_head()
    out = p.step(5.0, Events(round=Round(Verdict(alive=False, dead=True, reason="engine stalled"), None, 5.0)))
    # FAILED is shown before the stop, which can take stop_grace_s: clients see it at once.
    assert kinds(out) == ["record_round", "say", "state", "stop", "exit"]
    assert exit_of(out).code == EXIT_DIED and state_of(out) == (S.FAILED, "liveness lost: engine stalled")


def test_a_hung_engine_under_the_watchdog_is_left_to_systemd():
    p = serving_head(watchdog_s=2.0)
    hung = S.Liveness(ok=False, at=5.0, error="timed out")  # no latency: no answer at all
    out = p.step(5.0, Events(round=Round(Verdict(alive=False, dead=True, reason="probe failed (2/2)"), hung, 5.0)))
    assert exit_of(out) is None and "stop" not in kinds(out)
    assert state_of(out)[0] == S.FAILED and "watchdog restarts the node" in state_of(out)[1]
    assert not any("watchdog" in kinds(p.step(float(t), Events())) for t in range(7, 20))


# ------------------------------------------------------------------ the pair
def test_the_head_waits_for_every_worker_in_the_rendezvous_before_starting_vllm():
    p = policy(peers=[worker_peer()])
    out = p.start(0.0)
    assert kinds(out) == ["state", "poll_peers"] and p.state == S.RENDEZVOUS
    out = p.step(0.1, Events(peers={"w": AgentAnswer(None, refused=True)}))
    assert "start_vllm" not in kinds(out) and state_of(out)[1] == "waiting for w to enter the rendezvous"
    out = p.step(0.2, Events(peers={"w": agent(S.RENDEZVOUS)}))
    assert "start_vllm" in kinds(out) and p.committed


def test_the_head_gives_up_on_a_worker_after_worker_wait_timeout_s():
    p = policy(peers=[worker_peer()], limits={"worker_wait_timeout_s": 5.0})
    p.start(0.0)
    out = p.step(5.0, Events(peers={"w": agent(S.STARTING)}))
    assert exit_of(out).code == EXIT_NEVER_READY and "w at http://127.0.0.2:8890 is starting" in state_of(out)[1]


def paired_head(t: float = 0.0) -> NodePolicy:
    p = policy(peers=[worker_peer()])
    p.start(t)
    p.step(t + 0.1, Events(peers={"w": agent(S.RENDEZVOUS, started_at=7.0)}))
    return p


def test_a_worker_that_restarts_breaks_the_pair():
    p = paired_head()
    assert exit_of(p.step(1.0, Events(peers={"w": agent(S.RENDEZVOUS, started_at=7.0)}))) is None
    out = p.step(2.0, Events(peers={"w": agent(S.STARTING, started_at=8.0)}))
    assert exit_of(out).code == EXIT_NEVER_READY and "w restarted" in state_of(out)[1]
    assert "stop" in kinds(out)


def test_a_peer_whose_agent_refuses_after_answering_is_gone_at_once():
    p = paired_head()
    p.step(1.0, Events(peers={"w": agent(S.SERVING, started_at=7.0)}))
    out = p.step(2.0, Events(peers={"w": AgentAnswer(None, refused=True)}))
    assert "pair broken: w: its supervisor is gone: connection refused" in state_of(out)[1]


def test_a_silent_peer_is_lost_after_head_lost_s_and_not_before():
    p = paired_head()
    p.step(1.0, Events(peers={"w": agent(S.SERVING, started_at=7.0)}))
    timeout = AgentAnswer(None, error="timed out")
    assert exit_of(p.step(10.9, Events(peers={"w": timeout}))) is None
    out = p.step(11.1, Events(peers={"w": timeout}))
    assert exit_of(out) is not None and "unreachable for 10 s" in state_of(out)[1]


def test_a_worker_leaves_when_no_head_joins_within_rendezvous_timeout_s():
    p = policy(is_head=False, peers=[head_peer()], limits={"rendezvous_timeout_s": 20.0})
    p.start(0.0)
    p.step(1.0, Events(stage="rendezvous"))
    assert exit_of(p.step(19.0, Events(stage="rendezvous"))) is None
    out = p.step(21.0, Events(stage="rendezvous"))
    assert exit_of(out).code == EXIT_NEVER_READY and "no head joined" in state_of(out)[1]


def test_is_lost_is_the_one_rule():
    seen = {"state": S.SERVING}
    assert is_lost(agent(S.SERVING), seen, 0.0, 2.0) is None
    assert is_lost(agent(S.FAILED), seen, 0.0, 2.0) == "it is failed"
    assert is_lost(AgentAnswer(None, refused=True), None, None, 2.0) is None  # never seen: not up yet
    assert "connection refused" in is_lost(AgentAnswer(None, refused=True), seen, 0.5, 2.0)
    assert is_lost(AgentAnswer(None), seen, 1.9, 2.0) is None
    assert "unreachable for 2 s" in is_lost(AgentAnswer(None), seen, 2.0, 2.0)


# ------------------------------------------------------------------ signals, backoff, history
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_sigterm_and_sigint_stop_vllm_and_exit_0_clearing_the_history(sig):
    p = serving_head()
    out = p.step(3.0, Events(signal=sig))
    assert kinds(out) == ["state", "stop", "state", "exit"]
    assert exit_of(out).code == EXIT_OK and exit_of(out).history == "clear"


def test_sighup_restarts_through_a_failure_exit():
    p = serving_head()
    out = p.step(3.0, Events(signal=signal.SIGHUP))
    assert "stop" in kinds(out) and exit_of(out).code == EXIT_DIED and exit_of(out).history == "fail"
    assert "SIGHUP" in state_of(out)[1]


def test_the_backoff_waits_then_starts_and_a_sigterm_meanwhile_keeps_the_history():
    p = policy(track_history=True, failures=3, last_failure="exit 4: x")
    out = p.start(0.0)
    assert "starting in 10 s" in state_of(out)[1] and "start_vllm" not in kinds(out)
    assert "start_vllm" not in kinds(p.step(9.9, Events()))
    assert "start_vllm" in kinds(p.step(10.0, Events()))
    q = policy(track_history=True, failures=3, last_failure="exit 4: x")
    q.start(0.0)
    out = q.step(4.0, Events(signal=signal.SIGTERM))
    assert exit_of(out).code == EXIT_OK and exit_of(out).history == "keep" and "stop" not in kinds(out)


def test_serving_for_backoff_stable_s_clears_the_history_once():
    p = serving_head(track_history=True, failures=1)  # one failure: no backoff delay
    cleared = [t for t in range(1, 300, 10) if "clear_history" in kinds(p.step(float(t), Events()))]
    assert len(cleared) == 1 and cleared[0] >= BACKOFF_STABLE_S and p.failures == 0


def test_a_signal_before_anything_started_ends_quietly():
    p = policy()
    out = p.step(0.0, Events(signal=signal.SIGINT))
    assert exit_of(out).code == EXIT_OK and "stop" not in kinds(out) and exit_of(out).history == "keep"


def test_a_round_still_running_delays_the_next_and_it_starts_as_soon_as_that_one_ends():
    p = serving_head()
    assert "liveness_round" in kinds(p.step(6.0, Events()))
    # The round blocks on a slow /metrics: no second one meanwhile, however long it takes ...
    assert not any("liveness_round" in kinds(p.step(t, Events(running=frozenset({"round"}))))
                   for t in (8.0, 11.0, 14.0))
    # ... and the next starts the moment it has ended, not an interval later.
    done = Round(Verdict(alive=True), None, 14.5)
    assert "liveness_round" in kinds(p.step(14.5, Events(round=done)))


def test_a_finished_background_probe_wakes_the_loop_at_once():
    import threading

    from dspark.node.probes import Background
    from dspark.node.signals import SignalQueue

    q = SignalQueue()
    bg = Background("t", q.wake)
    gate = threading.Event()
    bg.start(lambda: gate.wait(5) and "result")
    assert bg.take() == (False, None) and bg.busy
    import time

    gate.set()
    t0 = time.monotonic()
    assert q.get(5.0) is None          # woken (not a signal) ...
    assert time.monotonic() - t0 < 2.0  # ... at once, not after the 5 s
    assert bg.take() == (True, "result") and not bg.busy
    q.put(signal.SIGTERM)
    assert q.get(0) == signal.SIGTERM


def test_a_worker_whose_head_stops_cleanly_stops_too_and_ends_stopped_not_failed():
    """Issue 34, item 2: after a clean stop the worker said `failed: pair broken: local-head: it
    is stopped` and the dashboard showed it FAILED. A head that shows STOPPED was stopped on
    purpose (its drain over): the worker stops as well, exit 0, vLLM killed at once (the other end
    of its collective is gone). A head lost or failed is still a broken pair."""
    w = policy(is_head=False, peers=[head_peer()])
    w.start(0.0)
    w.step(0.1, Events(stage="rendezvous"))
    w.step(1.2, Events(stage="loading", peers={"h": agent(S.RENDEZVOUS)}))
    w.step(2.4, Events(stage="warming", peers={"h": agent(S.SERVING)}))
    assert w.state == S.SERVING
    out = w.step(3.6, Events(peers={"h": agent(S.STOPPING)}))
    assert exit_of(out) is None  # the head drains: the worker's ranks serve its requests in flight
    out = w.step(4.8, Events(peers={"h": agent(S.STOPPED)}))
    e = exit_of(out)
    assert e is not None and e.code == EXIT_OK and state_of(out) == (S.STOPPED, "its head h stopped")
    stop = next(a for a in out if a.kind == "stop")
    assert stop.at_once
    f = policy(is_head=False, peers=[head_peer()])
    f.start(0.0)
    f.step(0.1, Events(stage="rendezvous"))
    f.step(1.2, Events(stage="loading", peers={"h": agent(S.RENDEZVOUS)}))
    e = exit_of(f.step(2.4, Events(peers={"h": agent(S.FAILED)})))
    assert e is not None and e.code != EXIT_OK


def test_a_second_signal_during_the_heads_drain_kills_vllm_at_once():
    p = policy(is_head=True, limits={"drain_s": 60.0})
    p.start(0.0)
    p.step(0.1, Events(stage="warming"))
    p.step(0.2, Events(stage="warming", ready_probe=good_probe(0.2)))
    out = p.step(1.0, Events(signal=signal.SIGTERM))
    assert "drain" in kinds(out) and exit_of(out) is None
    out = p.step(2.0, Events(signal=signal.SIGINT))
    stop = next(a for a in out if a.kind == "stop")
    assert stop.at_once and exit_of(out).code == EXIT_OK and "killed at once" in state_of(out)[1]
