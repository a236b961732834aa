"""The liveness policy (dspark.node.liveness) on its own, with a fake clock, and its parser on vLLM's
real /metrics text. The supervisor runs it against a stand-in in test_supervisor.py and against
the real local pair in test_liveness_pair.py."""

from pathlib import Path

import pytest

from dspark.node.liveness import PROBE, PROGRESS, LivenessJudge, Progress, read_progress

FIXTURES = Path(__file__).parents[1] / "dashboard" / "fixtures"


def judge(**kw) -> LivenessJudge:
    return LivenessJudge(**{"stall_s": 30.0, "probe_failures": 2, "fresh_s": 15.0, **kw})


def busy(work: float, running: int = 16, waiting: int = 17, started: float = 1.0) -> Progress:
    return Progress(running=running, waiting=waiting, work=work, started=started)


def idle(work: float, started: float = 1.0) -> Progress:
    return Progress(running=0, waiting=0, work=work, started=started)


def test_a_saturated_engine_that_advances_is_alive_without_any_probe():
    j = judge()
    for i in range(100):  # 500 s of saturation, a reading every 5 s
        v = j.observe(busy(1000 + 700 * i), now=5.0 * i)
        assert v.alive and not v.need_probe and not v.dead
    assert j.proof.kind == PROGRESS and j.proof.at == 5.0 * 99 and "16 running, 17 waiting" in j.proof.detail
    assert j.fed(5.0 * 99 + 15) and not j.fed(5.0 * 99 + 16)


def test_busy_with_nothing_advancing_is_a_stall_after_stall_s_and_not_before():
    j = judge(stall_s=30.0)
    assert j.observe(busy(500), 0.0).alive
    assert j.observe(busy(900), 5.0).alive               # last progress seen at t=5
    for t in (10.0, 15.0, 20.0, 25.0, 30.0):             # a long prefill chunk: no token counted yet
        v = j.observe(busy(900), t)
        assert v.alive and not v.dead, t
    assert j.proof.at == 5.0                              # the proof on record stays the real one
    v = j.observe(busy(900), 35.0)
    assert v.dead and not v.alive and "stalled" in v.reason and "30 s" in v.reason


def test_progress_resets_the_stall_clock():
    j = judge(stall_s=30.0)
    j.observe(busy(100), 0.0)
    j.observe(busy(100), 25.0)
    assert j.observe(busy(101), 29.0).alive
    assert not j.observe(busy(101), 58.0).dead
    assert j.observe(busy(101), 59.0).dead


def test_idle_asks_for_a_probe_and_the_probe_is_the_proof():
    j = judge()
    v = j.observe(idle(50), 0.0)
    assert v.need_probe and not v.alive
    v = j.probed(True, None, 0.04, idle(52), 0.1)
    assert v.alive and j.proof.kind == PROBE and "0.04 s" in j.proof.detail
    # The probe's own two tokens are not taken for progress at the next look.
    assert j.observe(idle(52), 5.0).need_probe


def test_failed_probes_while_idle_are_fatal_after_probe_failures():
    j = judge(probe_failures=2)
    j.observe(idle(50), 0.0)
    v = j.probed(False, "timed out", None, idle(50), 10.0)
    assert not v.alive and not v.dead and "1/2" in v.reason
    j.observe(idle(50), 15.0)
    v = j.probed(False, "timed out", None, idle(50), 25.0)
    assert v.dead and "2/2" in v.reason
    assert not j.fed(25.0)


def test_a_probe_starved_by_traffic_that_arrived_meanwhile_does_not_count():
    j = judge(probe_failures=1)
    j.observe(idle(50), 0.0)
    v = j.probed(False, "timed out", None, busy(4000), 10.0)  # 32 requests arrived and ran
    assert v.alive and not v.dead and j.proof.kind == PROGRESS and "starved" in j.proof.detail


def test_a_restarted_api_server_resets_the_counters_without_counting_as_progress():
    j = judge()
    j.observe(busy(10_000, started=1.0), 0.0)
    v = j.observe(busy(20, started=2.0), 5.0)     # counters restarted from zero
    assert v.alive and j.proof is None             # benefit of the doubt only, no proof
    assert j.observe(busy(40, started=2.0), 10.0).alive and j.proof.kind == PROGRESS


def test_no_metrics_answer_falls_back_to_the_probe():
    j = judge()
    v = j.observe(None, 0.0)
    assert v.need_probe and "metrics" in v.reason


@pytest.mark.parametrize("fixture", ["vllm_metrics_a.txt", "vllm_metrics_b.txt"])
def test_read_progress_on_vllm_metrics_text(fixture):
    text = (FIXTURES / fixture).read_text()
    p = read_progress(text)
    assert p.work > 0 and p.running >= 0 and p.waiting >= 0 and p.started is not None


def test_read_progress_refuses_what_is_not_vllm_metrics():
    with pytest.raises(ValueError):
        read_progress("<html>not metrics</html>")


def test_a_long_prefill_moves_the_kv_usage_before_any_token_is_counted():
    # vLLM counts a prompt's tokens when its prefill ends; each chunk allocates KV blocks.
    j = judge(stall_s=30.0)
    j.observe(Progress(running=1, waiting=0, work=100, kv_usage=0.01, started=1.0), 0.0)
    for i in range(1, 20):  # 95 s of chunks, no token counted
        v = j.observe(Progress(running=1, waiting=0, work=100, kv_usage=0.01 + 0.004 * i, started=1.0), 5.0 * i)
        assert v.alive and not v.dead
    assert "KV cache" in j.proof.detail
    assert j.observe(Progress(running=1, waiting=0, work=100, kv_usage=0.01 + 0.004 * 19, started=1.0), 130.0).dead
