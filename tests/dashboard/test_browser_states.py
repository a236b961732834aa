"""The page's context in Debian's headless Chromium, without the pair: the
dashboard's real collector and server, two real node agents, and vLLM's /metrics served from
the captured scrapes (edited where a state needs other counters). Screenshots are kept.

States: a prefill burst beside a small decode rate (each line on its own, labelled scale),
idle (what moves is the head's liveness probe, and the page says so), down (vLLM
unreachable, the head stopped: quiet dashes, no wall of red, no stale PIDs), and a runtime-line
switch (the line on every card, a node on another line than the head's marked, the
switch and its rollback in a strip while the head's state names one)."""

from __future__ import annotations

import re
import time

import pytest

from dspark.dashboard import collector as C
from dspark.dashboard import server as S
from dspark.node import agent as A
from dspark.node.states import LOADING, SERVING, STOPPED, Liveness, NodeState
from tests.harness.dashboard import scrape_text

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
           Object.fromEntries(Array.from(n.querySelectorAll('[data-field]')).map(e => [e.dataset.field,
                                                                                      e.textContent]))])),
  width: document.documentElement.clientWidth,
  history: box('[data-panel="history"]'), nodesPanel: box('[data-panel="nodes"]'),
  line: r('line') ? r('line').textContent : null,
  switching: r('switch') && !r('switch').hidden ? r('switch').textContent : null,
  otherLine: Array.from(document.querySelectorAll('.node.otherline')).map(n => n.dataset.node),
  borders: Object.fromEntries(Array.from(document.querySelectorAll('.node')).map(n => [n.dataset.node,
             getComputedStyle(n).borderTopColor])),
  warn: getComputedStyle(document.documentElement).getPropertyValue('--warn').trim(),
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
        "local-head": NodeState(node="local-head", rank=0, role="head", state=SERVING, vllm_pid=4242,
                                  vllm_version="0.28.0", runtime_line="v0.28.0", file_line="v0.28.0",
                                  liveness=Liveness(
                                      ok=True, at=time.time(), latency_s=0.05, proof="probe",
                                      proof_at=time.time(), proof_detail="1-token completion in 0.05 s")),
        "local-worker": NodeState(node="local-worker", rank=1, role="worker", state=SERVING, vllm_pid=4343,
                                    vllm_version="0.28.0", runtime_line="v0.28.0", file_line="v0.28.0"),
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
    states["local-head"].state, states["local-head"].vllm_pid = STOPPED, None
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


def rgb(hex_colour: str) -> str:
    h = hex_colour.lstrip("#")
    return "rgb({}, {}, {})".format(*(int(h[i:i + 2], 16) for i in (0, 2, 4)))


def test_runtime_line_on_every_card_other_line_marked_and_the_switch_shown(page, artifacts_dir):
    """A switch as the head's agent reports it: the head's state names the switch, the head comes
    back on the new line first and the worker follows; then a rollback."""
    driver, _, states, _ = page
    head, worker = states["local-head"], states["local-worker"]
    lines = lambda c: {name: n.get("runtime_line") for name, n in c["nodes"].items()}  # noqa: E731
    ctx = wait(driver, lambda c: lines(c) == {"local-head": "v0.28.0", "local-worker": "v0.28.0"})
    assert ctx["line"] == "v0.28.0" and ctx["switching"] is None and ctx["otherLine"] == []
    assert not any(n.get("linenote") for n in ctx["nodes"].values()), ctx["nodes"]

    head.line_switch = {"id": "20261202T174500Z-v0.28.0-to-v0.32.0", "from": "v0.28.0", "to": "v0.32.0",
                        "at": time.time(), "rollback": False}
    ctx = wait(driver, lambda c: c["switching"] is not None)
    assert ctx["switching"].startswith("switching v0.28.0 → v0.32.0"), ctx["switching"]
    assert "20261202T174500Z-v0.28.0-to-v0.32.0" in ctx["switching"]
    assert ctx["otherLine"] == []  # both still on v0.28.0

    # the head drains and restarts on v0.32.0; the worker is still on v0.28.0
    head.runtime_line, head.state, head.detail = "v0.32.0", LOADING, "loading the model on v0.32.0"
    ctx = wait(driver, lambda c: c["otherLine"] != [])
    driver.save_screenshot(str(artifacts_dir / "dashboard-line-switch.png"))
    assert ctx["otherLine"] == ["local-worker"]
    assert lines(ctx) == {"local-head": "v0.32.0", "local-worker": "v0.28.0"}
    assert ctx["line"] == "v0.32.0"
    note = ctx["nodes"]["local-worker"]["linenote"]
    assert "v0.28.0" in note and "the head" in note and "v0.32.0" in note, note
    assert ctx["nodes"]["local-head"]["linenote"] == ""
    assert ctx["borders"]["local-worker"] == rgb(ctx["warn"]), (ctx["borders"], ctx["warn"])
    assert ctx["borders"]["local-head"] != rgb(ctx["warn"]), ctx["borders"]
    assert ctx["switching"].startswith("switching v0.28.0 → v0.32.0")

    # the worker follows; the verdict is in (kept): one line, no strip, no mark
    worker.runtime_line = "v0.32.0"
    head.state, head.detail, head.line_switch = SERVING, "", None
    ctx = wait(driver, lambda c: c["switching"] is None and c["otherLine"] == [])
    assert lines(ctx) == {"local-head": "v0.32.0", "local-worker": "v0.32.0"} and ctx["line"] == "v0.32.0"
    assert ctx["borders"]["local-worker"] != rgb(ctx["warn"])

    # a rollback (the regression gate said no): the strip says so
    head.line_switch = {"id": "20261202T174500Z-v0.28.0-to-v0.32.0-rollback", "from": "v0.32.0",
                        "to": "v0.28.0", "at": time.time(), "rollback": True}
    ctx = wait(driver, lambda c: (c["switching"] or "").startswith("rolling back"))
    driver.save_screenshot(str(artifacts_dir / "dashboard-line-rollback.png"))
    assert ctx["switching"].startswith("rolling back v0.32.0 → v0.28.0"), ctx["switching"]
