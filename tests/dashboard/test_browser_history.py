"""The history charts, the request figures, the node's memory and the event timeline in Debian's
headless Chromium, without the pair: the dashboard's real collector and server, two real node
agents (their NodeState's own memory reading and event ring), and vLLM's /metrics from the
captured scrapes, edited where a chart needs other counters (errors, aborts, a queue). Each new
panel is kept as a screenshot of its own in test-artifacts/."""

from __future__ import annotations

import re
import time

import pytest

from dspark.dashboard import collector as C
from dspark.dashboard import server as S
from dspark.node import agent as A
from dspark.node.states import LOADING, SERVING, STARTING, STOPPING, Liveness, NodeState
from tests.harness.dashboard import scrape_text

from .test_browser_states import bump
from .test_memory_requests import bump_reason

pytestmark = pytest.mark.browser

PANELS = ("latency-history", "finished", "requests-history", "queue-history", "kv-history", "events")

READ = """
const q = (s) => document.querySelector(s), qa = (s) => Array.from(document.querySelectorAll(s));
const cells = (p) => qa(`[data-panel="${p}"] .v`).map((e) => e.textContent);
return {
  round: Number(document.body.dataset.round || 0),
  bands: {p50: qa('#chart-latency polygon.p50').length, p95: qa('#chart-latency polygon.p95').length},
  latencyTop: q('#y-latency').children[0].textContent,
  tab: q('#lat-tabs button.on').textContent,
  queue: {running: qa('#chart-queue polyline.running').length, waiting: qa('#chart-queue polyline.waiting').length},
  queueTop: q('#y-queue').children[0].textContent,
  kv: qa('#chart-kv polyline.kv').length,
  rate: qa('#chart-rate polyline.rate').length,
  errorBars: qa('#chart-rate rect.bar-errors').length, abortBars: qa('#chart-rate rect.bar-aborts').length,
  finished: cells('finished'),
  ticks: Object.fromEntries(qa('.xaxis').map((a) => [a.id, Array.from(a.children).map((e) => e.textContent)])),
  events: qa('#events li.event').map((e) => [e.dataset.node, e.dataset.kind,
                                             e.querySelector('.evdetail').textContent]),
  marks: qa('#chart-events .mark').map((e) => e.getAttribute('class')),
  memory: Object.fromEntries(qa('.node').map((n) => [n.dataset.node,
    [n.querySelector('[data-field=mem_used]').textContent, n.querySelector('[data-field=mem_free]').textContent,
     n.querySelector('[data-field=mem_used]').title, n.querySelector('.bar.mem > div').style.width]])),
};
"""


def read(driver) -> dict:
    return driver.execute_script(READ)


def wait(driver, pred, timeout: float = 20) -> dict:
    deadline = time.monotonic() + timeout
    page = read(driver)
    while not pred(page):
        if time.monotonic() > deadline:
            raise AssertionError(f"page did not reach the expected state in {timeout} s; last seen: {page}")
        time.sleep(0.2)
        page = read(driver)
    return page


@pytest.fixture
def page(metrics_stand_in, browser):
    now = time.time()
    states = {
        "local-head": NodeState(node="local-head", rank=0, role="head", state=SERVING, vllm_pid=4242,
                                  vllm_version="0.28.0", runtime_line="v0.28.0", restarts=1),
        "local-worker": NodeState(node="local-worker", rank=1, role="worker", state=SERVING, vllm_pid=4343,
                                    vllm_version="0.28.0", runtime_line="v0.28.0"),
    }
    head, worker = states["local-head"], states["local-worker"]
    # the head's ring as its supervisor fills it: through set_state's record_state and the hooks
    for st in (head, worker):
        st.state = STARTING
        for state, detail in [(STARTING, f"rank {st.rank} of 2"), (LOADING, "loading the model"),
                              (SERVING, "API on http://127.0.0.1:8000")]:
            st.record_state(state, detail)
            st.state = state
    head.liveness = Liveness(ok=True, at=now, proof="probe", proof_at=now, proof_detail="1-token completion")
    agents = {name: A.Agent("127.0.0.1", 0, st.snapshot).start() for name, st in states.items()}
    metrics_stand_in.text = scrape_text("a")
    nodes = tuple(C.NodeTarget(name, st.rank, st.role, f"http://127.0.0.1:{agents[name].port}")
                  for name, st in states.items())
    col = C.Collector(C.Targets(metrics_stand_in.url, nodes, served_name="dspark-local", liveness_interval_s=5.0),
                      interval_s=0.5, timeout_s=1.0).start()
    srv = S.DashboardServer("127.0.0.1", 0, col).start()
    browser.set_window_size(1600, 1400)
    browser.get(srv.url)
    try:
        yield browser, metrics_stand_in, states
    finally:
        srv.stop()
        col.stop()
        for a in agents.values():
            try:
                a.stop()
            except OSError:
                pass


def test_history_charts_requests_memory_and_timeline(page, artifacts_dir):
    driver, metrics, states = page
    wait(driver, lambda p: p["round"] >= 2)
    # the four captured requests, then a queue (3 running, 5 waiting), then an error and two aborts
    metrics.text = scrape_text("b")
    wait(driver, lambda p: p["bands"]["p50"] >= 1 and p["rate"] >= 1)
    queued = re.sub(r"^(vllm:num_requests_running\{[^}]*\}) .*$", r"\1 3.0", scrape_text("b"), flags=re.M)
    queued = re.sub(r"^(vllm:num_requests_waiting\{[^}]*\}) .*$", r"\1 5.0", queued, flags=re.M)
    metrics.text = bump(queued, "vllm:generation_tokens_total", 40)
    wait(driver, lambda p: p["queueTop"] == "5")
    metrics.text = bump(bump_reason(bump_reason(metrics.text, "error", 1), "abort", 2),
                        "vllm:generation_tokens_total", 40)
    # the head drains for a switch: its ring says so, and the page lists it
    head = states["local-head"]
    head.line_switch = {"id": "s-1", "from": "v0.28.0", "to": "v0.32.0", "rollback": False, "at": time.time()}
    head.record_state(STOPPING, "switching to runtime line v0.32.0: draining the requests in flight (up to 60 s)")
    head.state = STOPPING
    p = wait(driver, lambda p: p["errorBars"] >= 1 and p["abortBars"] >= 1
             and any(k == "drain" for _, k, _ in p["events"]))

    assert p["bands"]["p95"] >= 1 and p["tab"] == "TTFT" and re.fullmatch(r"[\d.]+ (ms|s)", p["latencyTop"]), p
    assert p["queue"] == {"running": 1, "waiting": 1} and p["kv"] >= 1, p
    # rate now, rate over the window; errors and aborts in the window and since vLLM started
    assert len(p["finished"]) == 6 and p["finished"][2:] == ["1", "1", "2", "2"], p["finished"]
    assert re.fullmatch(r"\d+\.\d\d", p["finished"][1]), p["finished"]
    for axis, labels in p["ticks"].items():  # clock times on every axis, "now" last
        assert labels[-1] == "now" and all(re.fullmatch(r"\d\d:\d\d(:\d\d)?", t) for t in labels[:-1]), (axis, labels)
        assert len(labels) >= 3, (axis, labels)  # 150 s at 0.5 s a poll: ticks every 30 s
    kinds = [(n, k) for n, k, _ in p["events"]]
    assert kinds[0] == ("local-head", "drain"), kinds  # newest first
    for expected in [("local-head", "switch"), ("local-head", "liveness"), ("local-head", "serving"),
                     ("local-head", "stage"), ("local-head", "restart"), ("local-worker", "start"),
                     ("local-worker", "serving")]:
        assert expected in kinds, (expected, kinds)
    assert any("v0.28.0 → v0.32.0 under way (s-1)" in d for _, k, d in p["events"] if k == "switch"), p["events"]
    assert any("kind-restart" in c for c in p["marks"]) and any("kind-drain" in c for c in p["marks"]), p["marks"]
    for name, (used, free, title, width) in p["memory"].items():  # this host's /proc/meminfo, read by each agent
        assert re.fullmatch(r"\d+\.\d of \d+\.\d GiB", used) and re.fullmatch(r"\d+\.\d GiB", free), (name, used)
        assert "meminfo" in title or "NVML" in title, title
        assert width.endswith("%") and 0 < float(width[:-1]) <= 100, width

    # another latency on the tabs: inter-token
    driver.find_element("css selector", '#lat-tabs button[data-lat="itl_s"]').click()
    p = wait(driver, lambda p: p["tab"] == "inter-token" and p["bands"]["p50"] >= 1)

    for panel in PANELS:
        el = driver.find_element("css selector", f'[data-panel="{panel}"]')
        driver.execute_script("arguments[0].scrollIntoView({block: 'center'});", el)
        el.screenshot(str(artifacts_dir / f"dashboard-panel-{panel}.png"))
    card = driver.find_element("css selector", '.node[data-node="local-head"]')
    driver.execute_script("arguments[0].scrollIntoView({block: 'center'});", card)
    card.screenshot(str(artifacts_dir / "dashboard-panel-node-memory.png"))
    driver.save_screenshot(str(artifacts_dir / "dashboard-history-viewport.png"))
