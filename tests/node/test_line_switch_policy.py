"""The node policy's part of a runtime-line switch (dspark.node.policy), on a fake clock: the
head leaves its line when its state says another (draining first when serving), a worker of the
same cluster file follows its head's line, a failure during a switch holds the node (agent up,
vLLM stopped) until the pair's line changes, and a pair of two different cluster files on two
lines is still refused. The real processes run the same policy in tests/switch/test_switch_local.py."""

import signal

from dspark.node import states as S
from dspark.node.agent_client import AgentAnswer
from dspark.node.events import EXIT_SWITCH, Events
from dspark.node.policy import EXIT_DIED, EXIT_NEVER_READY, EXIT_OK
from tests.node.test_node_policy import exit_of, good_probe, head_peer, kinds, policy, state_of, worker_peer

A, B = "v0.28.0", "v0.32.0"


def answer(state: str, line: str, file_line: str = A, switch: dict | None = None, started_at: float = 1.0):
    return AgentAnswer({"state": state, "started_at": started_at, "runtime_line": line, "file_line": file_line,
                        "line_switch": switch})


SW = {"id": "s1", "from": A, "to": B, "at": 0.0, "rollback": False}


def head(line=A, **kw):
    return policy(is_head=True, peers=[worker_peer()], runtime_line=line, file_line=A,
                  installed=frozenset({A, B}), **kw)


def worker(line=A, installed=frozenset({A, B}), **kw):
    return policy(is_head=False, peers=[head_peer()], runtime_line=line, file_line=A, installed=installed, **kw)


def serving_pair_head(drain_s=0.0):
    p = head(limits={"drain_s": drain_s})
    p.start(0.0)
    out = p.step(0.1, Events(peers={"w": answer(S.RENDEZVOUS, A)}))
    assert "start_vllm" in kinds(out)
    p.step(0.2, Events(stage="warming"))
    p.step(0.3, Events(stage="warming", ready_probe=good_probe(0.3)))
    assert p.ready
    return p


def test_a_serving_head_whose_state_names_another_line_drains_then_ends_the_run_for_that_line():
    p = serving_pair_head(drain_s=20.0)
    out = p.step(1.0, Events(wanted_line=A, switching=False))
    assert exit_of(out) is None and "drain" not in kinds(out)      # its own line: nothing happens
    out = p.step(2.0, Events(wanted_line=B, switching=True))
    assert "drain" in kinds(out) and state_of(out)[0] == S.STOPPING and B in state_of(out)[1]
    out = p.step(3.0, Events(vllm_exit=0, wanted_line=B, switching=True))
    e = exit_of(out)
    assert e is not None and e.code == EXIT_SWITCH and p.switch_to == B
    assert state_of(out)[0] == S.STOPPING  # never STOPPED: the pair goes on


def test_a_head_without_a_drain_stops_vllm_at_once_for_a_switch():
    p = serving_pair_head(drain_s=0.0)
    out = p.step(2.0, Events(wanted_line=B, switching=True))
    assert kinds(out).count("stop") == 1 and exit_of(out).code == EXIT_SWITCH


def test_a_head_waiting_for_a_worker_still_on_the_old_line_of_the_same_file_waits_for_it():
    p = head(line=B, switching=True)
    p.start(0.0)
    out = p.step(0.5, Events(peers={"w": answer(S.SERVING, A)}, wanted_line=B, switching=True))
    assert exit_of(out) is None and "start_vllm" not in kinds(out)
    assert "waiting for w" in state_of(out)[1]
    out = p.step(1.5, Events(peers={"w": answer(S.RENDEZVOUS, B)}, wanted_line=B, switching=True))
    assert "start_vllm" in kinds(out)


def test_a_worker_of_another_cluster_file_on_another_line_is_still_refused():
    p = head(line=A)
    p.start(0.0)
    out = p.step(0.5, Events(peers={"w": answer(S.RENDEZVOUS, B, file_line=B)}))
    e = exit_of(out)
    assert e is not None and e.code == EXIT_NEVER_READY and "two runtime lines" in state_of(out)[1]


def test_a_worker_follows_its_heads_line_and_a_head_of_another_file_is_not_followed():
    w = worker()
    w.start(0.0)
    w.step(0.1, Events(stage="rendezvous"))
    out = w.step(1.2, Events(stage="rendezvous", peers={"h": answer(S.RENDEZVOUS, A)}))
    assert exit_of(out) is None
    out = w.step(2.4, Events(stage="rendezvous", peers={"h": answer(S.RENDEZVOUS, B, switch=SW, started_at=2.0)}))
    e = exit_of(out)
    assert e is not None and e.code == EXIT_SWITCH and w.switch_to == B and "stop" in kinds(out)
    other = worker()
    other.start(0.0)
    other.step(0.1, Events(stage="rendezvous"))
    out = other.step(1.2, Events(stage="rendezvous", peers={"h": answer(S.RENDEZVOUS, B, file_line=B)}))
    assert exit_of(out) is None and other.switch_to is None


def test_a_worker_without_the_heads_line_holds_and_comes_back_when_the_head_returns():
    w = worker(installed=frozenset({A}))
    w.start(0.0)
    w.step(0.1, Events(stage="rendezvous"))
    out = w.step(1.2, Events(stage="rendezvous", peers={"h": answer(S.RENDEZVOUS, B, switch=SW)}))
    assert exit_of(out) is None and state_of(out)[0] == S.FAILED and "not installed" in state_of(out)[1]
    assert "stop" in kinds(out) and w.phase == "held"
    out = w.step(5.0, Events(peers={"h": answer(S.RENDEZVOUS, B, switch=SW)}))
    assert exit_of(out) is None and "poll_peers" in kinds(out)
    back = dict(SW, id="s1-rollback", **{"from": B, "to": A, "rollback": True})
    out = w.step(7.0, Events(peers={"h": answer(S.STOPPING, A, switch=back, started_at=7.0)}))
    e = exit_of(out)
    assert e is not None and e.code == EXIT_SWITCH and w.switch_to == A


def test_a_failure_during_a_switch_holds_until_the_line_changes_and_otherwise_gives_up():
    p = head(line=B, switching=True)
    p.start(0.0)
    p.step(0.1, Events(peers={"w": answer(S.RENDEZVOUS, B)}, wanted_line=B, switching=True))
    out = p.step(0.5, Events(vllm_exit=1, wanted_line=B, switching=True))
    assert exit_of(out) is None and state_of(out)[0] == S.FAILED and "holding" in state_of(out)[1]
    out = p.step(3.0, Events(wanted_line=B, switching=True))
    assert exit_of(out) is None
    out = p.step(4.0, Events(wanted_line=A, switching=True))  # rolled back
    assert exit_of(out).code == EXIT_SWITCH and p.switch_to == A
    q = head(line=B, switching=True)
    q.start(0.0)
    q.step(0.1, Events(peers={"w": answer(S.RENDEZVOUS, B)}, wanted_line=B, switching=True))
    q.step(0.5, Events(vllm_exit=1, wanted_line=B, switching=True))
    assert exit_of(q.step(50.0, Events(wanted_line=B, switching=True))) is None
    e = exit_of(q.step(101.0, Events(wanted_line=B, switching=True)))  # max(ready 100, worker wait 30)
    assert e is not None and e.code == EXIT_NEVER_READY


def test_a_failure_outside_a_switch_exits_as_before_and_a_signal_while_held_stops():
    p = head(line=A)
    p.start(0.0)
    p.step(0.1, Events(peers={"w": answer(S.RENDEZVOUS, A)}))
    e = exit_of(p.step(0.5, Events(vllm_exit=1)))
    assert e is not None and e.code == EXIT_NEVER_READY
    q = head(line=B, switching=True)
    q.start(0.0)
    q.step(0.1, Events(peers={"w": answer(S.RENDEZVOUS, B)}, wanted_line=B, switching=True))
    q.step(0.5, Events(vllm_exit=1, wanted_line=B, switching=True))
    e = exit_of(q.step(1.0, Events(signal=signal.SIGTERM)))
    assert e is not None and e.code == EXIT_OK


def test_under_systemds_watchdog_a_switch_keeps_feeding_it_while_it_drains_and_the_next_run_starts():
    # WatchdogSec is armed by the first run's READY: a switch's drain and the next run's start
    # (waiting for the worker, loading) must feed it, or systemd kills the node mid-switch.
    p = serving_pair_head(drain_s=60.0)
    p.watchdog_s = 5.0
    p.step(1.0, Events(wanted_line=B, switching=True))
    dogs = sum(kinds(p.step(t, Events(wanted_line=B, switching=True))).count("watchdog") for t in range(2, 30, 1))
    assert dogs >= 5
    nxt = head(line=B, switching=True, watchdog_s=5.0, resumed=True)
    nxt.start(0.0)
    dogs = sum(kinds(nxt.step(t, Events(peers={"w": answer(S.SERVING, A)}, wanted_line=B, switching=True)))
               .count("watchdog") for t in range(1, 30, 1))
    assert dogs >= 5
    first = head(line=A, watchdog_s=5.0)  # a first start is the start timeout's business, not the watchdog's
    first.start(0.0)
    assert not any("watchdog" in kinds(first.step(t, Events(peers={"w": answer(S.STARTING, A)}))) for t in range(1, 30))


def serving_worker():
    """A worker paired with head incarnation 1.0, serving line A."""
    w = worker()
    w.start(0.0)
    w.step(0.1, Events(stage="rendezvous"))
    w.step(1.2, Events(stage="loading", peers={"h": answer(S.RENDEZVOUS, A)}))
    w.step(2.4, Events(stage="warming", peers={"h": answer(S.SERVING, A)}))
    assert w.state == S.SERVING and w.paired
    return w


def test_a_worker_whose_head_restarts_on_its_line_during_a_switch_re_forms_the_pair_there():
    """Issue 33, item 9: a Ctrl-C during the head's drain brings the head back on the old line (a
    new incarnation). The worker, which never moved, re-forms the pair with it (worker first into
    the rendezvous) instead of failing and holding for a line change that never comes."""
    back = dict(SW, id="s1-rollback", **{"from": B, "to": A, "rollback": True})
    w = serving_worker()
    out = w.step(5.0, Events(peers={"h": answer(S.RENDEZVOUS, A, switch=back, started_at=5.0)}))
    e = exit_of(out)
    assert e is not None and e.code == EXIT_SWITCH and w.switch_to == A, out
    assert "re-forms" in state_of(out)[1] and state_of(out)[0] == S.STOPPING
    # The same restart with no switch under way is a broken pair, as before (systemd restarts it).
    w = serving_worker()
    e = exit_of(w.step(5.0, Events(peers={"h": answer(S.RENDEZVOUS, A, started_at=5.0)})))
    assert e is not None and e.code == EXIT_DIED


def test_a_held_worker_re_forms_with_a_restarted_head_and_a_hold_ends_with_the_switch():
    back = dict(SW, id="s1-rollback", **{"from": B, "to": A, "rollback": True})
    w = serving_worker()
    w.step(4.0, Events(peers={"h": answer(S.SERVING, A, switch=back)}))  # a switch under way
    out = w.step(5.0, Events(vllm_exit=1))
    assert exit_of(out) is None and w.phase == "held"
    out = w.step(6.0, Events(peers={"h": answer(S.RENDEZVOUS, A, switch=back, started_at=6.0)}))
    assert exit_of(out).code == EXIT_SWITCH and w.switch_to == A and "re-forms" in state_of(out)[1]
    # Held, and the head's switch record is gone (a verdict, or resolved): the failure is a failure.
    w = serving_worker()
    w.step(4.0, Events(peers={"h": answer(S.SERVING, A, switch=back)}))  # a switch under way
    w.step(5.0, Events(vllm_exit=1))
    assert exit_of(w.step(6.0, Events())) is None  # the head not answering: nothing learnt
    out = w.step(7.0, Events(peers={"h": answer(S.SERVING, A)}))
    e = exit_of(out)
    assert e is not None and e.code == EXIT_DIED and "the switch is over" in state_of(out)[1]
    # A held head whose state loses its record ends too.
    p = head(line=B, switching=True)
    p.start(0.0)
    p.step(0.1, Events(peers={"w": answer(S.RENDEZVOUS, B)}, wanted_line=B, switching=True))
    p.step(0.5, Events(vllm_exit=1, wanted_line=B, switching=True))
    e = exit_of(p.step(3.0, Events(wanted_line=B, switching=False)))
    assert e is not None and e.code == EXIT_NEVER_READY

