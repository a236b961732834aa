"""The page at any node count: 2, 4 and 8 nodes at 1,280, 1,600 and 1,920 px
in Debian's headless Chromium, without the pair: the dashboard's real collector and server, real
node agents serving wide but real-shaped states (7-digit PIDs, a day of uptime, three-digit
proof ages, GPU and NVMe readings, a GB10's memory, a runtime-line switch under way with the last
node still on the old line: the switch strip, a runtime line on every card and one card's warning
note; events of every kind with long details in each node's ring), and vLLM's /metrics from a
captured scrape. The history charts (throughput, latency, request rate, queue, KV cache) and the
event timeline are measured with the rest, and each time axis must carry clock-time ticks.

Overflow is read from the DOM, not judged by eye: every value and label must fit its own box
and its card, every label and value must stay on one line, and the page must not scroll
sideways. One Chromium session serves all nine combinations (its start is the slow part);
each combination leaves a screenshot in test-artifacts/."""

from __future__ import annotations

import re
import time

import pytest

from dspark.dashboard import collector as C
from dspark.dashboard import server as S
from dspark.engine import facts as F
from dspark.node import agent as A
from dspark.node.states import SERVING, Liveness, NodeState
from tests.harness.browser import chromium
from tests.harness.dashboard import MetricsStandIn, scrape_text

from .test_percentiles import IDLE_PROBES, metrics_text

pytestmark = pytest.mark.browser

NODE_COUNTS = (2, 4, 8)
WIDTHS = (1280, 1600, 1920)
HEIGHT = 1000
HARDWARE = {"gpus": [{"name": "NVIDIA GB10", "temperature_c": 71.0, "power_w": 123.4, "utilization_pct": 100.0}],
            "nvme_temperature_c": 58.0}
# A GB10's unified memory, mostly taken (the widest figures a card shows: "118.9 of 119.7 GiB")
GB10_MEMORY = {"total_bytes": 128_526_266_368, "used_bytes": 127_650_000_000, "available_bytes": 876_266_368,
               "source": "meminfo"}

# Values (one line, inside their card), labels (one line, inside their card) and free text
# that may wrap but must stay inside its card. A card is a node card, else a panel, else the header.
MEASURE = """
const VALUES = '.v, .state, .badge';
const LABELS = 'th, td:not(.v), h2, h3, header .meta, .axis > span, .yaxis > span, .evtime, .evnode, .evkind';
const TEXT = '.detail, .note, .linenote, .banner, .evdetail';
const card = (e) => e.closest('.node') || e.closest('.panel') || e.closest('header');
const lines = (e) => {
  const r = document.createRange(); r.selectNodeContents(e);
  const tops = [];
  for (const b of r.getClientRects()) {
    if (b.width > 0 && !tops.some((t) => Math.abs(t - b.top) < 3)) tops.push(b.top);
  }
  return tops.length;
};
const describe = (e) => (e.dataset.field || e.dataset.panel || e.tagName.toLowerCase()) + ' "' +
  e.textContent.trim().slice(0, 40) + '" in ' + ((card(e) && (card(e).dataset.node || card(e).dataset.panel))
  || (card(e) && card(e).tagName.toLowerCase()) || 'page');
const out = {clipped: [], outside: [], wrapped: [], checked: 0,
             scrollWidth: document.scrollingElement.scrollWidth, innerWidth: window.innerWidth,
             cards: document.querySelectorAll('.node').length,
             lines: Array.from(document.querySelectorAll('.node [data-field=runtime_line]')).map((e) => e.textContent),
             ticks: Object.fromEntries(Array.from(document.querySelectorAll('.xaxis')).map((a) => [a.id,
               Array.from(a.children).map((e) => e.textContent)])),
             memory: Array.from(document.querySelectorAll('.node [data-field=mem_used]')).map((e) => e.textContent),
             eventRows: Array.from(document.querySelectorAll('#y-events > span')).map((e) => e.textContent),
             marks: document.querySelectorAll('#chart-events .mark').length,
             events: document.querySelectorAll('#events li.event').length};
const seen = new Set();
for (const [sel, oneLine] of [[VALUES, true], [LABELS, true], [TEXT, false]]) {
  for (const e of document.querySelectorAll(sel)) {
    if (seen.has(e) || e.offsetParent === null || !e.textContent.trim()) continue;  // hidden or empty
    seen.add(e);
    out.checked += 1;
    const b = e.getBoundingClientRect();
    if (e.clientWidth > 0 && e.scrollWidth > e.clientWidth) out.clipped.push(describe(e) +
      ` (scrollWidth ${e.scrollWidth} > clientWidth ${e.clientWidth})`);
    const c = card(e);
    if (c) {
      const k = c.getBoundingClientRect();
      if (b.left < k.left - 0.5 || b.right > k.right + 0.5) out.outside.push(describe(e) +
        ` (${b.left.toFixed(0)}..${b.right.toFixed(0)} outside ${k.left.toFixed(0)}..${k.right.toFixed(0)})`);
    }
    if (oneLine && lines(e) > 1) out.wrapped.push(describe(e) + ` (${lines(e)} lines)`);
  }
}
return out;
"""


SWITCH = {"id": "20261202T174500Z-v0.28.0-to-v0.32.0", "from": "v0.28.0", "to": "v0.32.0", "rollback": False}
EVENTS = [("restart", "restart 12; rank 0 of 8; runtime line v0.28.0"),
          ("stage", "loading: Starting to load model /var/lib/dspark/models/DeepSeek-V4-Flash"),
          ("serving", "API on http://192.168.100.10:8000"),
          ("liveness", "not alive: the 1-token completion timed out after 30 s; no progress for 45 s while "
                       "4 requests ran (generated tokens and KV-cache usage unchanged)"),
          ("switch", "runtime-line switch v0.28.0 → v0.32.0 under way (20261202T174500Z-v0.28.0-to-v0.32.0)"),
          ("drain", "switching to runtime line v0.32.0: draining the requests in flight (up to 60 s)")]


def node_states(n: int) -> dict[str, NodeState]:
    now = time.time()
    states = {}
    for rank in range(n):
        name = f"dgx-spark-{rank + 1:02d}"
        # mid-switch: the head and all but the last worker came back on v0.32.0
        st = NodeState(node=name, rank=rank, role="head" if rank == 0 else "worker", state=SERVING,
                         vllm_pid=4_194_300 + rank, vllm_version="0.28.0", restarts=12,
                         started_at=now - 100_000, state_since=now - 90_000,
                         runtime_line="v0.28.0" if rank == n - 1 else "v0.32.0", file_line="v0.28.0")
        for i, (kind, detail) in enumerate(EVENTS):
            st.record(kind, detail, at=now - 100 + 12 * i + rank / 2)  # inside the charts' 150 s
        if rank == 0:
            st.detail = "serving: API on http://192.168.100.10:8000"
            st.api_url = "http://192.168.100.10:8000"
            st.liveness = Liveness(ok=True, at=now, proof="progress", proof_at=now - 100,
                                     proof_detail="generated tokens moved")
            st.line_switch = {**SWITCH, "at": now - 7_000}
        else:
            st.detail = "vLLM is in the rendezvous"
        states[name] = st
    return states


class Dashboard:
    """n real agents, a collector and a server on loopback."""

    def __init__(self, n: int, metrics_url: str):
        self.states = node_states(n)
        # The agent's answer with hardware readings, the shape the collector takes from an agent.
        self.agents = {name: A.Agent("127.0.0.1", 0, lambda st=st: {**st.snapshot(), "hardware": HARDWARE,
                                                                    "memory": GB10_MEMORY}).start()
                       for name, st in self.states.items()}
        nodes = tuple(C.NodeTarget(name, st.rank, st.role, f"http://127.0.0.1:{self.agents[name].port}")
                      for name, st in self.states.items())
        self.collector = C.Collector(C.Targets(metrics_url, nodes, served_name="deepseek-v4-flash",
                                               liveness_interval_s=5.0), interval_s=0.5, timeout_s=1.0).start()
        self.server = S.DashboardServer("127.0.0.1", 0, self.collector).start()

    def close(self) -> None:
        self.server.stop()
        self.collector.stop()
        for a in self.agents.values():
            try:
                a.stop()
            except OSError:
                pass


@pytest.fixture(scope="module")
def session():
    """One Chromium and one dashboard per node count for the whole module."""
    metrics = MetricsStandIn(scrape_text("a"))
    dashboards: dict[int, Dashboard] = {}
    try:
        with chromium() as driver:
            for n in NODE_COUNTS:
                dashboards[n] = Dashboard(n, metrics.url)
            yield driver, dashboards, metrics
    finally:
        for d in dashboards.values():
            d.close()
        metrics.close()


def show(driver, url: str, width: int, n: int) -> dict:
    driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                           {"width": width, "height": HEIGHT, "deviceScaleFactor": 1, "mobile": False})
    driver.get(url)
    deadline = time.monotonic() + 20
    while True:
        state = driver.execute_script(
            "return {round: Number(document.body.dataset.round || 0), cards: document.querySelectorAll('.node').length,"
            " pid: (document.querySelector('.node [data-field=vllm_pid]') || {}).textContent || '',"
            " marked: document.querySelectorAll('.node.otherline').length,"
            " strip: !document.getElementById('switch').hidden};")
        if state["round"] >= 2 and state["cards"] == n and state["pid"].isdigit() and state["marked"] == 1 \
                and state["strip"]:
            return state
        if time.monotonic() > deadline:
            raise AssertionError(f"the page did not render {n} nodes: {state}")
        time.sleep(0.2)


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("nodes", NODE_COUNTS)
def test_nothing_clipped_wrapped_or_scrolling(session, nodes, width, artifacts_dir):
    driver, dashboards, _ = session
    show(driver, dashboards[nodes].server.url, width, nodes)
    time.sleep(0.6)  # one more round: the figures of a second scrape are in the cells
    m = driver.execute_script(MEASURE)
    shot = artifacts_dir / f"dashboard-layout-{nodes}-nodes-{width}px.png"
    driver.save_screenshot(str(shot))
    print(f"{nodes} nodes at {width} px: {m['checked']} elements, {len(m['clipped'])} clipped, "
          f"{len(m['outside'])} outside their card, {len(m['wrapped'])} wrapped, page "
          f"{m['scrollWidth']} px wide in {m['innerWidth']} px; {shot}")
    assert m["cards"] == nodes
    assert m["lines"] == ["v0.32.0"] * (nodes - 1) + ["v0.28.0"], m["lines"]  # measured with the rest
    assert m["checked"] > 60, m  # the measure saw the page, not an empty one
    assert m["memory"] == ["118.9 of 119.7 GiB"] * nodes, m["memory"]
    # every chart's time axis: clock times between its ends, "now" at the right
    assert set(m["ticks"]) == {"x-chart", "x-latency", "x-rate", "x-queue", "x-kv", "x-events"}, m["ticks"]
    for axis, labels in m["ticks"].items():
        assert labels[-1] == "now" and len(labels) >= 2, (axis, labels)
        assert all(re.fullmatch(r"\d\d:\d\d(:\d\d)?", t) for t in labels[:-1]), (axis, labels)
    # the timeline: a row per node, every node's events marked and listed
    assert m["eventRows"] == [f"dgx-spark-{r + 1:02d}" for r in range(nodes)], m["eventRows"]
    recorded = sum(len(st.events) for st in dashboards[nodes].states.values())  # the head's switch and verdict too
    assert m["marks"] >= nodes * len(EVENTS) and m["events"] == min(40, recorded), (m, recorded)
    assert m["innerWidth"] == width
    problems = m["clipped"] + m["outside"] + m["wrapped"]
    assert not problems, "\n".join(problems)
    assert m["scrollWidth"] <= m["innerWidth"], f"the page scrolls sideways: {m['scrollWidth']} px"


def test_worker_liveness_says_the_head_proves_it(session):
    """Only the head runs liveness rounds: a worker's field says so, never a bare "n/a"."""
    driver, dashboards, _ = session
    show(driver, dashboards[4].server.url, 1600, 4)
    cells = driver.execute_script(
        "return Array.from(document.querySelectorAll('.node')).map(n => {"
        " const c = n.querySelector('[data-field=liveness]');"
        " return [n.dataset.node, c.textContent, c.title, c.closest('tr').cells[0].textContent]; });")
    head, *workers = cells
    assert head[1].startswith("progress, ") and head[1].endswith(" s ago"), head
    for name, text, title, _label in workers:
        assert text == "via the head", (name, text)
        assert "head" in title and "every rank" in title, (name, title)
    assert {c[3] for c in cells} == {"alive by"}


def test_idle_latency_cells_say_what_the_buckets_prove(session, artifacts_dir):
    """Twelve ~22 ms liveness probes in the window, all in vLLM's first end-to-end bucket (0-300 ms):
    the mean is exact, and the median reads as the bound the buckets and that mean prove (at most
    twice the mean), no longer a 150 ms median beside a 22.1 ms mean."""
    driver, dashboards, metrics = session
    metrics.text = metrics_text({F.E2E: [2.84]})
    show(driver, dashboards[2].server.url, 1280, 2)
    col, deadline = dashboards[2].collector, time.monotonic() + 15
    seen = col.rounds
    while col.rounds < seen + 2:  # the window starts at a scrape of this text (a reset: it replaced the capture)
        assert time.monotonic() < deadline, "the collector did not scrape"
        time.sleep(0.1)
    metrics.text = metrics_text({F.E2E: [2.84] + IDLE_PROBES})
    deadline = time.monotonic() + 15
    read = ("const c = document.querySelectorAll('[data-panel=latency] tr')[3].cells;"
            " return [c[1].textContent, c[2].textContent, c[3].textContent, c[2].title];")
    while (cells := driver.execute_script(read))[0] != "22.1 ms":
        assert time.monotonic() < deadline, cells
        time.sleep(0.2)
    driver.save_screenshot(str(artifacts_dir / "dashboard-latency-idle-probes.png"))
    mean, p50, p95, title = cells
    assert p50 == "≤ 44.2 ms" and p95 == "≤ 265.2 ms", cells
    assert "bucket 0.0–300.0 ms (width 300.0 ms), 12 requests" in title, title
