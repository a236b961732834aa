"""The node's memory (dspark.node.host_memory, in the agent's /state as `memory`) and the finished
requests (rate, errors, aborts from vllm:request_success's finished_reason), through the real
agent and the real collector; the reasons' values come from a real vLLM 0.28.0 scrape."""

from __future__ import annotations

import json
import os
import re
import urllib.request

import pytest

from dspark.dashboard import collector as C
from dspark.dashboard import rates
from dspark.engine import facts as F
from dspark.node import agent as A
from dspark.node import host_memory
from dspark.node.states import SERVING, NodeState
from tests.harness.dashboard import scrape_text, validate_snapshot

from .test_collector import targets


def nvml_importable() -> bool:
    try:
        import pynvml  # noqa: F401
    except ImportError:
        return False
    return True


# ------------------------------------------------------------------ memory

def test_host_memory_is_the_kernels(tmp_path):
    """Here (no NVML): /proc/meminfo, whose MemTotal is the kernel's physical memory (sysconf)."""
    m = host_memory.HostMemory().read()
    assert m is not None and set(m) == {"total_bytes", "used_bytes", "available_bytes", "source"}
    if nvml_importable():
        pytest.skip("pynvml is installed here: the reading may be NVML's")
    assert m["source"] == "meminfo"
    assert m["total_bytes"] == os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert m["used_bytes"] + m["available_bytes"] == m["total_bytes"]
    assert 0 < m["available_bytes"] <= m["total_bytes"]
    # an NVML that finds no device reads as not answering: the meminfo figures stand
    assert host_memory.Nvml().read() is None


@pytest.mark.parametrize("content", [
    None,                                                  # no such file
    b"",                                                   # empty
    b"MemTotal: 1000 kB\n",                                # no MemAvailable
    b"MemTotal: lots kB\nMemAvailable: 10 kB\n",           # not a number
    b"MemTotal: 0 kB\nMemAvailable: 0 kB\n",               # nothing
    b"MemTotal: 99999999999999999999 kB\nMemAvailable: 1 kB\n",  # absurd
    b"x" * (host_memory.MAX_MEMINFO_BYTES + 1),            # past the bound
    b"\xff\xfe\x00garbage\nMemTotal:\n",
])
def test_a_meminfo_of_another_shape_reads_as_unknown(tmp_path, content):
    path = tmp_path / "meminfo"
    if content is not None:
        path.write_bytes(content)
    assert host_memory.from_meminfo(path) is None
    assert host_memory.HostMemory(meminfo=path).read() in (None, host_memory.Nvml().read())


def test_available_above_total_is_clamped(tmp_path):
    path = tmp_path / "meminfo"
    path.write_text("MemTotal:       1000 kB\nMemFree: 5 kB\nMemAvailable:   2000 kB\n")
    assert host_memory.from_meminfo(path) == {"total_bytes": 1024000, "used_bytes": 0, "available_bytes": 1024000,
                                              "source": "meminfo"}


def test_the_agent_serves_memory_and_the_collector_shows_it(metrics_stand_in, agents):
    states, running = agents
    with urllib.request.urlopen(f"http://127.0.0.1:{running['node-a'].port}/state", timeout=5) as r:
        state = json.loads(r.read())
    mem = state["memory"]
    assert mem["source"] in host_memory.SOURCES and mem["used_bytes"] + mem["available_bytes"] == mem["total_bytes"]
    metrics_stand_in.text = scrape_text("a")
    snap = C.Collector(targets(metrics_stand_in.url, running), timeout_s=2.0).tick()
    validate_snapshot(snap)
    for n in snap["nodes"]:
        assert n["memory"]["total_bytes"] == mem["total_bytes"] and n["memory"]["source"] == mem["source"]


@pytest.mark.parametrize("memory", [None, "lots", {"total_bytes": -1, "used_bytes": 0, "available_bytes": 0,
                                                   "source": "meminfo"},
                                    {"total_bytes": 10, "used_bytes": 1, "available_bytes": 9, "source": "guess"},
                                    {"total_bytes": True, "used_bytes": 1, "available_bytes": 9, "source": "nvml"}])
def test_a_memory_of_another_shape_is_not_shown(metrics_stand_in, memory):
    st = NodeState(node="n", rank=0, role="head", state=SERVING)
    agent = A.Agent("127.0.0.1", 0, lambda: {**st.snapshot(), "memory": memory}).start()
    try:
        metrics_stand_in.text = scrape_text("a")
        snap = C.Collector(targets(metrics_stand_in.url, {"n": agent}), timeout_s=2.0).tick()
    finally:
        agent.stop()
    validate_snapshot(snap)
    assert snap["nodes"][0]["memory"] is None


# ------------------------------------------------------------------ finished requests

def bump_reason(text: str, reason: str, by: float) -> str:
    pat = re.compile(rf'^(vllm:request_success_total\{{[^}}]*finished_reason="{reason}"[^}}]*\}}) ([0-9.e+]+)$', re.M)
    assert pat.search(text), reason
    return pat.sub(lambda m: f"{m.group(1)} {float(m.group(2)) + by}", text)


def test_finished_by_reason_in_a_real_scrape():
    assert rates.finished_by_reason(scrape_text("a")) == {"stop": 0, "length": 3, "abort": 0, "error": 0,
                                                           "repetition": 0}
    assert rates.finished_by_reason(scrape_text("b"))["length"] == 7
    # the stand-in vLLM's shape (tests/harness/standin_vllm.py): no finished_reason, so no errors or aborts known
    assert rates.finished_by_reason('vllm:request_success_total{engine="0",model_name="m"} 4\n') is None
    assert rates.finished_by_reason('vllm:request_success_total{finished_reason="error" 4\n') is None


def test_request_rate_errors_and_aborts(metrics_stand_in, agents):
    states, running = agents
    col = C.Collector(targets(metrics_stand_in.url, running), timeout_s=2.0)
    metrics_stand_in.text = scrape_text("a")
    first = col.tick()["vllm"]["finished"]
    assert first["per_s"] is None and first["total"] == 3 and first["errors_total"] == first["aborts_total"] == 0
    metrics_stand_in.text = scrape_text("b")
    snap = col.tick()
    validate_snapshot(snap)
    fin = snap["vllm"]["finished"]
    dt = col.scrapes[-1].at - col.scrapes[-2].at
    assert fin["total"] == 7 and fin["per_s"] == pytest.approx(4 / dt, rel=1e-2)
    assert fin["errors_interval"] == fin["aborts_interval"] == 0 and fin["errors_window"] == 0

    metrics_stand_in.text = bump_reason(bump_reason(scrape_text("b"), "error", 1), "abort", 2)
    snap = col.tick()
    validate_snapshot(snap)
    fin = snap["vllm"]["finished"]
    assert (fin["errors_interval"], fin["aborts_interval"]) == (1, 2)
    assert (fin["errors_window"], fin["aborts_window"]) == (1, 2)
    assert (fin["errors_total"], fin["aborts_total"]) == (1, 2)
    assert fin["total"] == 10 and fin["per_s"] > 0
    h = snap["history"]
    assert h["errors"] == [None, 0, 1] and h["aborts"] == [None, 0, 2]
    assert h["requests_per_s"][0] is None and h["requests_per_s"][1] > 0

    # vLLM restarted (its counters from zero): the new process's own, never a negative figure
    metrics_stand_in.text = scrape_text("a").replace("process_start_time_seconds 1.", "process_start_time_seconds 2.")
    fin = col.tick()["vllm"]["finished"]
    assert fin["errors_interval"] == 0 and fin["per_s"] >= 0 and fin["errors_window"] == 0


def test_no_reasons_no_errors_claimed(metrics_stand_in, agents):
    """A vLLM that does not say why requests finished: the rate, but errors and aborts unknown."""
    states, running = agents
    col = C.Collector(targets(metrics_stand_in.url, running), timeout_s=2.0)
    text = re.sub(r',?finished_reason="[a-z]+"', "", scrape_text("b"))
    text = "\n".join(line for line in text.splitlines() if 'request_success_total{' not in line
                     or line.endswith(" 7.0") or "length" in line) + "\n"
    metrics_stand_in.text = text
    col.tick()
    snap = col.tick()
    validate_snapshot(snap)
    fin = snap["vllm"]["finished"]
    assert fin["errors_total"] is fin["aborts_total"] is fin["errors_window"] is fin["errors_interval"] is None
    assert fin["per_s"] == 0 and fin["total"] is not None


def test_latency_ranges_in_the_history(metrics_stand_in, agents):
    states, running = agents
    col = C.Collector(targets(metrics_stand_in.url, running), timeout_s=2.0)
    metrics_stand_in.text = scrape_text("a")
    col.tick()
    metrics_stand_in.text = scrape_text("b")
    snap = col.tick()
    validate_snapshot(snap)
    lat, now = snap["history"]["latency"], snap["vllm"]["latency"]
    for key in ("ttft_s", "itl_s", "e2e_s"):
        assert set(lat[key]) == {"p50_low", "p50_high", "p95_low", "p95_high"}
        assert all(len(v) == 2 for v in lat[key].values())
        assert [lat[key]["p50_low"][-1], lat[key]["p50_high"][-1]] == now[key]["p50_range"]
        assert [lat[key]["p95_low"][-1], lat[key]["p95_high"][-1]] == now[key]["p95_range"]
    assert lat["itl_s"]["p50_low"][-1] is not None and lat["itl_s"]["p50_low"][-1] <= now["itl_s"]["p50"]
    assert snap["history"]["running"][-1] == 0 and snap["history"]["kv_cache_usage"][-1] is not None
    assert F.FINISHED_ERROR == "error" and F.FINISHED_ABORT == "abort"
