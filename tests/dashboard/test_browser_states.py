"""The page's context in Debian's headless Chromium (issue 15 item 5), without the pair: the
dashboard's real collector and server, two real node agents, and vLLM's /metrics served from
the captured scrapes (edited where a state needs other counters). Screenshots are kept.

States: a prefill burst beside a small decode rate (each line on its own, labelled scale),
idle (what moves is the head's liveness probe, and the page says so), and down (vLLM
unreachable, the head stopped: quiet dashes, no wall of red, no stale PIDs)."""

from __future__ import annotations

import re
import time

import pytest

from dspark import agent as A
from dspark.dashboard import collector as C
from dspark.dashboard import server as S

from .browser import wait_for
from .helpers import scrape_text

pytestmark = pytest.mark.browser

READ_CONTEXT = """
const r = (id) => document.getElementById(id);
const box = (sel) => { const b = document.querySelector(sel).getBoundingClientRect();
                       return {left: b.left, top: b.top, right: b.right}; };
return {
  model: r('model') ? r('model').textContent : null,
  version: r('version').textContent,
  yDecode: r('y-decode') ? Array.from(r('y-decode').children).map(e => e.textContent) : null,
  yPrefill: r('y-prefill') ? Array.from(r('y-prefill').children).map(e => e.textContent) : null,
  idleNote: r('idle-note') && !r('idle-note').hidden ? r('idle-note').textContent : null,
  latencyTitle: document.querySelector('[data-panel="latency"] h2').textContent,
  red: Array.from(document.querySelectorAll('.unavailable')).map(e => e.textContent),
  cells: Array.from(document.querySelectorAll('[data-panel] .v')).map(e => e.textContent),
  nodes: Object.fromEntries(Array.from(document.querySelectorAll('.node')).map(n => [n.dataset.node,
           Object.fromEntries(Array.from(n.querySelectorAll('[data-field]')).map(e => [e.dataset.field, e.textContent]))])),
  width: document.documentElement.clientWidth,
  history: box('[data-panel="history"]'), nodesPanel: box('[data-panel="nodes"]'),
  round: Number(document.body.dataset.round || 0),
};
"""


def context(driver) -> dict:
    return driver.execute_script(READ_CONTEXT)


def num(text: str) -> float:
    return float(text.replace(",", ""))


def bump(text: str, metric: str, by: float) -> str:
    """The scrape with `metric`'s (single-series) counter raised by `by`."""
    pat = re.compile(rf"^({re.escape(metric)}\{{[^}}]*\}}) ([0-9.e+]+)$", re.M)
    assert pat.search(text), metric
    return pat.sub(lambda m: f"{m.group(1)} {float(m.group(2)) + by}", text)


@pytest.fixture
def page(metrics_stand_in, browser):
    states = {
        "local-head": A.NodeState(node="local-head", rank=0, role="head", state=A.SERVING, vllm_pid=4242,
                                  vllm_version="0.28.0", liveness=A.Liveness(
                                      ok=True, at=time.time(), latency_s=0.05, proof="probe",
                                      proof_at=time.time(), proof_detail="1-token completion in 0.05 s")),
        "local-worker": A.NodeState(node="local-worker", rank=1, role="worker", state=A.SERVING, vllm_pid=4343,
                                    vllm_version="0.28.0"),
    }
    agents = {name: A.Agent("127.0.0.1", 0, st.snapshot).start() for name, st in states.items()}
    metrics_stand_in.text = scrape_text("a")
    nodes = tuple(C.NodeTarget(name, st.rank, st.role, f"http://127.0.0.1:{agents[name].port}")
                  for name, st in states.items())
    col = C.Collector(C.Targets(metrics_stand_in.url, nodes, served_name="dspark-local",
                                liveness_interval_s=5.0), interval_s=0.5, timeout_s=1.0).start()
    srv = S.DashboardServer("127.0.0.1", 0, col).start()
    browser.get(srv.url)
    try:
        yield browser, metrics_stand_in, states, agents
    finally:
        srv.stop()
        col.stop()
        for a in agents.values():
            try:
                a.stop()
            except OSError:
                pass


def wait(driver, pred, timeout: float = 15) -> dict:
    deadline = time.monotonic() + timeout
    ctx = context(driver)
    while not pred(ctx):
        if time.monotonic() > deadline:
            raise AssertionError(f"page did not reach the expected state in {timeout} s; last seen: {ctx}")
        time.sleep(0.2)
        ctx = context(driver)
    return ctx


def test_prefill_and_decode_have_their_own_labelled_scales(page, artifacts_dir):
    driver, metrics, _, _ = page
    wait(driver, lambda c: c["round"] >= 2)
    # One interval: the four captured requests' 192 generated tokens, and a 40,000-token prefill.
    metrics.text = bump(scrape_text("b"), "vllm:prompt_tokens_total", 40_000)
    ctx = wait(driver, lambda c: c["yPrefill"] is not None and num(c["yPrefill"][0]) > 1_000)
    driver.save_screenshot(str(artifacts_dir / "dashboard-prefill-burst.png"))
    assert ctx["model"] == "dspark-local"
    decode_top, prefill_top = num(ctx["yDecode"][0]), num(ctx["yPrefill"][0])
    # decode's scale is its own: its top is within a factor of a few of its peak, not 40,000+
    assert 100 <= decode_top <= 1_000, ctx["yDecode"]
    assert prefill_top >= 40_000, ctx["yPrefill"]
    assert ctx["yDecode"][2] == ctx["yPrefill"][2] == "0"


def test_idle_says_the_liveness_probe_is_what_moves(page, artifacts_dir):
    driver, _, _, _ = page
    ctx = wait(driver, lambda c: c["round"] >= 2 and c["idleNote"] is not None)
    driver.save_screenshot(str(artifacts_dir / "dashboard-idle.png"))
    assert "liveness probe" in ctx["idleNote"] and "every 5 s" in ctx["idleNote"]
    assert "only while the engine is idle" in ctx["idleNote"]
    assert re.fullmatch(r"probe, \d+ s ago", ctx["nodes"]["local-head"]["liveness"]), ctx["nodes"]
    # the right third of the page holds the nodes, beside the history chart
    assert ctx["nodesPanel"]["left"] > ctx["width"] * 0.6, ctx["nodesPanel"]
    assert abs(ctx["nodesPanel"]["top"] - ctx["history"]["top"]) < 2


def test_down_pair_shows_quiet_dashes_not_red_cells_and_stale_figures(page, artifacts_dir):
    driver, metrics, states, agents = page
    wait(driver, lambda c: c["nodes"].get("local-head", {}).get("vllm_pid") == "4242")
    states["local-head"].state, states["local-head"].vllm_pid = A.STOPPED, None
    time.sleep(1.5)  # the collector sees "stopped" before the agent goes
    metrics.close()
    agents["local-head"].stop()
    ctx = wait(driver, lambda c: c["nodes"]["local-head"]["state"] == "stopped" and "—" in c["cells"]
               and "gone" in c["nodes"]["local-head"]["detail"])
    driver.save_screenshot(str(artifacts_dir / "dashboard-down.png"))
    assert ctx["red"] == [], ctx["red"]
    assert "unavailable" not in ctx["cells"]
    head = ctx["nodes"]["local-head"]
    assert head["vllm_pid"] == head["uptime"] == head["restarts"] == "—", head
    assert ctx["nodes"]["local-worker"]["vllm_pid"] == "4343"  # the worker still answers
    assert ctx["version"] == "—"
    assert "last" not in ctx["latencyTitle"] and "down" in ctx["latencyTitle"], ctx["latencyTitle"]
