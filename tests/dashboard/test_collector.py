"""The collector's pure parts on real scrapes of the local pair, and the collector thread
against real node agents and a /metrics stand-in (malformed, unreachable, restarted)."""

from __future__ import annotations

import time

import pytest

from dspark.dashboard import collector as C
from dspark.dashboard import rates
from dspark.engine import facts as F
from dspark.engine.metrics import Histogram, MetricsError, parse
from dspark.node import hardware
from dspark.node.states import FAILED, LOADING, SERVING, STOPPING, Liveness, NodeState
from tests.harness.dashboard import MetricsStandIn, scrape_text, validate_snapshot

DT = 2.997  # seconds between the two captured scrapes (fixtures/README.md)


def scrapes():
    return parse(scrape_text("a"), at=100.0), parse(scrape_text("b"), at=100.0 + DT)


# ------------------------------------------------------------------ parsing and rates

def test_parse_real_scrape():
    a, b = scrapes()
    assert a.counters[F.GENERATION_TOKENS] == 3 and b.counters[F.GENERATION_TOKENS] == 195
    assert b.counters[F.PROMPT_TOKENS] == 115
    assert b.gauges[F.RUNNING] == 0 and b.gauges[F.WAITING] == 0
    assert 0 <= b.gauges[F.KV_USAGE] <= 1
    assert b.histograms[F.ITL].count == 188
    assert b.histograms[F.TTFT].buckets[-1] == (float("inf"), b.histograms[F.TTFT].count)
    assert a.process_start == b.process_start
    assert F.SPEC_DRAFT_TOKENS not in b.counters  # the local pair runs without speculative decoding


def test_rates_from_two_real_scrapes():
    a, b = scrapes()
    iv = rates.interval(a, b)
    assert not iv.reset and iv.active
    assert iv.generation_tokens == 4 * 48 and iv.prompt_tokens == 16 + 24 + 32 + 40
    assert iv.decode_tps == pytest.approx(192 / DT)
    assert iv.prefill_tps == pytest.approx(112 / DT)
    assert iv.spec_acceptance is None


def test_latency_window_from_two_real_scrapes():
    a, b = scrapes()
    ttft = rates.latency(a, b, F.TTFT)
    ha, hb = a.histograms[F.TTFT], b.histograms[F.TTFT]
    assert ttft["window_mean"] == pytest.approx((hb.sum - ha.sum) / 4)
    assert ttft["lifetime_mean"] == pytest.approx(hb.sum / hb.count)
    assert 0 < ttft["p50"] <= ttft["p95"]
    itl = rates.latency(a, b, F.ITL)
    assert itl["window_mean"] == pytest.approx(b.histograms[F.ITL].sum / 188)  # none before the window


def test_counter_reset_never_gives_a_negative_rate():
    a, b = scrapes()
    after_restart = parse(scrape_text("a"), at=b.at + 1.0)  # counters back to small values
    iv = rates.interval(b, after_restart)
    assert iv.reset
    assert iv.generation_tokens == 3 and iv.decode_tps == pytest.approx(3.0)
    assert iv.prefill_tps >= 0
    assert rates.latency(b, after_restart, F.TTFT)["window_mean"] >= 0


def test_restart_seen_by_process_start_time_even_when_counters_grew():
    a, b = scrapes()
    text = scrape_text("b").replace("process_start_time_seconds 1.79604360457e+09",
                                    "process_start_time_seconds 1.79604400000e+09")
    assert text != scrape_text("b")
    restarted = parse(text, at=a.at + DT)
    iv = rates.interval(a, restarted)
    assert iv.reset and iv.generation_tokens == 195  # all of it counted since the restart


@pytest.mark.parametrize("text", [
    "",  # an empty answer
    "<html><body>502 Bad Gateway</body></html>",
    'vllm:generation_tokens_total{engine="0" 12\n',  # unterminated labels
    "vllm:generation_tokens_total abc\n",
    "# TYPE vllm:generation_tokens counter\nvllm:generation_tokens_total 5\n",  # lacks the other families
    "\x00\x01binary\xff",
], ids=["empty", "html", "labels", "value", "incomplete", "binary"])
def test_malformed_text_is_an_error_not_a_crash(text):
    with pytest.raises(MetricsError):
        parse(text, at=0.0)


def test_truncated_real_scrape_is_an_error():
    text = scrape_text("b")
    with pytest.raises(MetricsError):
        parse(text[: text.index("vllm:num_requests_running{") + 30], at=0.0)


def test_quantile_interpolates_like_prometheus():
    h = Histogram(count=10, sum=5.0, buckets=((0.1, 2), (0.5, 6), (1.0, 10), (float("inf"), 10)))
    assert rates.quantile(0.5, h) == pytest.approx(0.1 + 0.4 * (5 - 2) / 4)
    assert rates.quantile(0.95, h) == pytest.approx(0.5 + 0.5 * (9.5 - 6) / 4)
    over = Histogram(count=2, sum=50.0, buckets=((1.0, 0), (float("inf"), 2)))
    assert rates.quantile(0.5, over) == 1.0  # beyond the last finite bound: that bound
    assert rates.quantile(0.5, Histogram(0, 0.0, ())) is None


def test_spec_decode_figures():
    # vLLM 0.28.0 exposes these counters only with a speculative config; the names are from
    # dspark.engine.facts, the values made up for the arithmetic.
    extra = "".join(f"# TYPE {name}_total counter\n{name}_total{{engine=\"0\"}} {value}\n"
                    for name, value in ((F.SPEC_DRAFTS, 10), (F.SPEC_DRAFT_TOKENS, 50), (F.SPEC_ACCEPTED_TOKENS, 30)))
    s = parse(scrape_text("b") + extra, at=0.0)
    assert rates.spec_decode(s) == {"drafts": 10, "draft_tokens": 50, "accepted_tokens": 30,
                                    "acceptance_rate": 0.6, "mean_acceptance_length": 4.0}
    assert rates.spec_decode(parse(scrape_text("b"), at=0.0)) is None


# ------------------------------------------------------------------ hardware

def test_nvme_temperature_from_hwmon(tmp_path):
    for i, (name, milli) in enumerate([("acpitz", 90000), ("nvme", 41850), ("nvme", 38850)]):
        d = tmp_path / f"hwmon{i}"
        d.mkdir()
        (d / "name").write_text(name + "\n")
        (d / "temp1_input").write_text(f"{milli}\n")
    assert hardware.nvme_temperature_c(tmp_path) == pytest.approx(41.85)
    assert hardware.nvme_temperature_c(tmp_path / "missing") is None


def test_no_nvml_reads_as_not_available():
    try:
        import pynvml  # noqa: F401
    except ImportError:
        assert hardware.Gpu().read() == []
    else:
        pytest.skip("pynvml is installed here; the n/a path needs a host without it")


# ------------------------------------------------------------------ the collector

def targets(api_url: str, running: dict) -> C.Targets:
    nodes = tuple(C.NodeTarget(name, i, "head" if i == 0 else "worker", f"http://127.0.0.1:{a.port}")
                  for i, (name, a) in enumerate(sorted(running.items())))
    return C.Targets(api_url=api_url, nodes=nodes, local_node="node-a")


def test_collector_round_with_real_scrapes(metrics_stand_in, agents, tmp_path):
    states, running = agents
    metrics_stand_in.text = scrape_text("a")
    col = C.Collector(targets(metrics_stand_in.url, running), hwmon=tmp_path)
    col.tick()
    metrics_stand_in.text = scrape_text("b")
    snap = col.tick()
    validate_snapshot(snap)
    v = snap["vllm"]
    assert v["available"] and v["error"] is None and v["version"] == "0.28.0"
    assert v["throughput"]["decode_tps"]["current"] > 0
    assert v["throughput"]["decode_tps"]["active_avg"] == v["throughput"]["decode_tps"]["current"]
    assert v["tokens"]["generation_total"] == 195
    assert v["spec_decode"] is None
    assert [n["state"] for n in snap["nodes"]] == ["serving", "serving"]
    assert snap["nodes"][1]["restarts"] == 2
    assert snap["nodes"][0]["hardware"]["source"] == "local"
    assert snap["nodes"][1]["hardware"] == {"source": None, "gpus": [], "nvme_temperature_c": None}
    assert snap["serving"] is True
    assert len(snap["history"]["t"]) == 2


def test_collector_unavailable_then_recovers(metrics_stand_in, agents):
    states, running = agents
    col = C.Collector(targets(metrics_stand_in.url, running))
    metrics_stand_in.text = "this is not prometheus text {{{"
    assert "no vLLM metrics" in col.tick()["vllm"]["error"]
    metrics_stand_in.text = scrape_text("b").replace("vllm:num_requests_running{", "vllm:num_requests_running{{")
    snap = col.tick()
    validate_snapshot(snap)
    assert snap["vllm"]["available"] is False and "malformed" in snap["vllm"]["error"]
    assert snap["vllm"]["throughput"] is None and snap["serving"] is False
    assert snap["nodes"][0]["state"] == "serving"  # the agents are still read
    metrics_stand_in.status, metrics_stand_in.text = 503, "busy"
    assert "HTTP 503" in col.tick()["vllm"]["error"]
    metrics_stand_in.status, metrics_stand_in.text = 200, scrape_text("b")
    snap = col.tick()
    assert snap["vllm"]["available"] is True
    assert snap["history"]["decode_tps"][:2] == [None, None]


def test_collector_unreachable_metrics_and_agents():
    # a port nothing listens on: take one, then close it
    s = MetricsStandIn()
    url = s.url
    s.close()
    col = C.Collector(C.Targets(api_url=url, nodes=(C.NodeTarget("x", 0, "head", url),)), timeout_s=1.0)
    snap = col.tick()
    validate_snapshot(snap)
    assert snap["vllm"]["available"] is False and snap["vllm"]["error"].startswith("unreachable")
    assert snap["nodes"][0]["state"] == "unreachable" and snap["nodes"][0]["reachable"] is False


def test_agent_gone_reads_failed_at_once(metrics_stand_in, agents):
    """A refused connection: the node's supervisor (and its agent) exited."""
    states, running = agents
    metrics_stand_in.text = scrape_text("b")
    col = C.Collector(targets(metrics_stand_in.url, running), timeout_s=1.0)
    col.tick()
    running["node-b"].stop()
    snap = col.tick()
    assert snap["nodes"][1]["state"] == "failed" and "connection refused" in snap["nodes"][1]["detail"]
    assert snap["nodes"][1]["reachable"] is False and snap["serving"] is False
    validate_snapshot(snap)


def test_silent_agent_reads_failed_after_grace(metrics_stand_in):
    """An agent that stops answering (host or network gone: timeouts) gets one missed round."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    hang = threading.Event()
    release = threading.Event()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            if hang.is_set():
                release.wait(10)
                return
            body = json.dumps(NodeState(node="n", rank=0, role="head", state=SERVING).snapshot()).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        metrics_stand_in.text = scrape_text("b")
        url = f"http://127.0.0.1:{srv.server_address[1]}"
        col = C.Collector(C.Targets(metrics_stand_in.url, (C.NodeTarget("n", 0, "head", url),)), timeout_s=0.5)
        assert col.tick()["nodes"][0]["state"] == "serving"
        hang.set()
        snap = col.tick()
        assert snap["nodes"][0]["state"] == "serving" and snap["nodes"][0]["reachable"] is False  # one miss
        time.sleep(C.LOST_AFTER_S)
        snap = col.tick()
        assert snap["nodes"][0]["state"] == "failed" and "unreachable for" in snap["nodes"][0]["detail"]
        validate_snapshot(snap)
    finally:
        release.set()
        srv.shutdown()
        srv.server_close()


def test_agent_reported_failure_and_orderly_stop(metrics_stand_in, agents):
    states, running = agents
    metrics_stand_in.text = scrape_text("b")
    col = C.Collector(targets(metrics_stand_in.url, running), timeout_s=1.0)
    states["node-b"].state, states["node-b"].detail = FAILED, "vLLM exited with code -9 while serving"
    states["node-a"].state = STOPPING
    snap = col.tick()
    assert snap["nodes"][1]["state"] == "failed" and "-9" in snap["nodes"][1]["detail"]
    running["node-a"].stop()
    time.sleep(C.LOST_AFTER_S)
    assert col.tick()["nodes"][0]["state"] == "stopped"


def test_history_is_bounded(metrics_stand_in, agents):
    states, running = agents
    metrics_stand_in.text = scrape_text("b")
    col = C.Collector(targets(metrics_stand_in.url, running), history_len=5)
    for _ in range(8):
        snap = col.tick()
    assert len(snap["history"]["t"]) == 5 and snap["history"]["capacity"] == 5
    assert col.scrapes.maxlen is not None


def test_one_poller_for_many_clients(metrics_stand_in, agents):
    """N readers of the snapshot do not add scrapes: the thread scrapes once per interval."""
    import threading

    states, running = agents
    metrics_stand_in.text = scrape_text("b")
    col = C.Collector(targets(metrics_stand_in.url, running), interval_s=0.5).start()
    stop = threading.Event()

    def reader():
        while not stop.is_set():
            assert col.snapshot_json().startswith(b"{")
            time.sleep(0.01)

    readers = [threading.Thread(target=reader) for _ in range(8)]
    try:
        for r in readers:
            r.start()
        time.sleep(2.6)
    finally:
        stop.set()
        for r in readers:
            r.join(timeout=5)
        col.stop()
    assert 3 <= metrics_stand_in.hits <= 7  # about 2.6 s / 0.5 s, whatever the 8 readers did
    assert metrics_stand_in.hits == col.rounds


def test_collector_spec_decode_when_present(metrics_stand_in, agents):
    # The local pair runs without speculative decoding; these counters (names from
    # dspark.engine.facts, values made up) are appended to a real scrape.
    def with_spec(drafts, drafted, accepted):
        return scrape_text("b") + "".join(
            f"# TYPE {name}_total counter\n{name}_total{{engine=\"0\"}} {value}\n"
            for name, value in ((F.SPEC_DRAFTS, drafts), (F.SPEC_DRAFT_TOKENS, drafted),
                                (F.SPEC_ACCEPTED_TOKENS, accepted)))

    states, running = agents
    col = C.Collector(targets(metrics_stand_in.url, running))
    metrics_stand_in.text = with_spec(10, 50, 30)
    col.tick()
    metrics_stand_in.text = with_spec(16, 80, 45)
    snap = col.tick()
    validate_snapshot(snap)
    spec = snap["vllm"]["spec_decode"]
    assert spec["acceptance_rate"] == {"current": 0.5, "lifetime": round(45 / 80, 4)}
    assert spec["mean_acceptance_length"] == round(1 + 45 / 16, 3)


def test_collector_shows_which_proof_of_life_the_head_used_last(metrics_stand_in, agents):
    states, running = agents
    metrics_stand_in.text = scrape_text("b")
    col = C.Collector(targets(metrics_stand_in.url, running), timeout_s=1.0)
    assert col.tick()["nodes"][0]["liveness"] is None  # no round yet
    states["node-a"].liveness = Liveness(ok=True, at=time.time(), proof="progress", proof_at=time.time() - 3,
                                           proof_detail="712 tokens since the last look; 16 running, 17 waiting")
    snap = col.tick()
    validate_snapshot(snap)
    live = snap["nodes"][0]["liveness"]
    assert live["ok"] and live["proof"] == "progress" and 2.5 <= live["proof_age_s"] <= 10
    assert "16 running" in live["proof_detail"] and snap["nodes"][1]["liveness"] is None


# ------------------------------------------------------------------ runtime lines

def switch_record(frm: str, to: str, *, rollback: bool = False, ago_s: float = 0.0) -> dict:
    """The head's line_switch as dspark.lines.state.Switch.to_json() writes it."""
    sid = f"20261202T174500Z-{frm if not rollback else to}-to-{to if not rollback else frm}"
    return {"id": sid + ("-rollback" if rollback else ""), "from": frm, "to": to, "at": time.time() - ago_s,
            "rollback": rollback}


def test_collector_reports_each_nodes_line_and_the_switch(metrics_stand_in, agents):
    states, running = agents
    head, worker = states["node-a"], states["node-b"]
    metrics_stand_in.text = scrape_text("b")
    col = C.Collector(targets(metrics_stand_in.url, running), timeout_s=1.0)
    # an agent of a dspark before runtime lines reports none: nothing is claimed, nothing marked
    snap = col.tick()
    validate_snapshot(snap)
    assert [n["runtime_line"] for n in snap["nodes"]] == [None, None]
    assert [n["other_line"] for n in snap["nodes"]] == [False, False]
    assert snap["runtime_line"] == {"head": None, "mixed": False, "switch": None}

    for st in (head, worker):
        st.runtime_line = st.file_line = "v0.28.0"
    snap = col.tick()
    validate_snapshot(snap)
    assert [(n["runtime_line"], n["file_line"], n["other_line"]) for n in snap["nodes"]] == \
        [("v0.28.0", "v0.28.0", False)] * 2
    assert snap["runtime_line"] == {"head": "v0.28.0", "mixed": False, "switch": None}

    # dspark switch wrote the head's state: the head drains and comes back on v0.32.0 first,
    # the worker is still on v0.28.0 (it follows once it sees the head's line)
    head.line_switch = switch_record("v0.28.0", "v0.32.0", ago_s=30)
    head.runtime_line, head.state = "v0.32.0", LOADING
    snap = col.tick()
    validate_snapshot(snap)
    assert [(n["runtime_line"], n["other_line"]) for n in snap["nodes"]] == [("v0.32.0", False), ("v0.28.0", True)]
    line = snap["runtime_line"]
    assert line["head"] == "v0.32.0" and line["mixed"] is True
    sw = line["switch"]
    assert (sw["from"], sw["to"], sw["rollback"], sw["id"]) == \
        ("v0.28.0", "v0.32.0", False, "20261202T174500Z-v0.28.0-to-v0.32.0")
    assert 29 <= sw["for_s"] <= 60
    assert snap["nodes"][0]["file_line"] == "v0.28.0"  # the cluster file still names the old line

    # the worker followed, the verdict is in (kept): one line again, no switch
    worker.runtime_line, head.state, head.line_switch = "v0.32.0", SERVING, None
    snap = col.tick()
    validate_snapshot(snap)
    assert [n["other_line"] for n in snap["nodes"]] == [False, False]
    assert snap["runtime_line"] == {"head": "v0.32.0", "mixed": False, "switch": None}

    # a rollback is a switch too, marked as one
    head.line_switch = switch_record("v0.32.0", "v0.28.0", rollback=True)
    snap = col.tick()
    validate_snapshot(snap)
    sw = snap["runtime_line"]["switch"]
    assert (sw["from"], sw["to"], sw["rollback"]) == ("v0.32.0", "v0.28.0", True) and 0 <= sw["for_s"] < 30

    # a record the dashboard cannot read is no switch (and no crash)
    head.line_switch = {"id": "x", "from": None, "to": 3}
    snap = col.tick()
    validate_snapshot(snap)
    assert snap["runtime_line"]["switch"] is None

    # a worker whose agent is gone: its last line is kept (the card greys it) but not compared
    head.line_switch, worker.runtime_line = None, "v0.28.0"
    assert col.tick()["runtime_line"]["mixed"] is True
    running["node-b"].stop()
    snap = col.tick()
    validate_snapshot(snap)
    assert snap["nodes"][1]["reachable"] is False and snap["nodes"][1]["runtime_line"] == "v0.28.0"
    assert snap["nodes"][1]["other_line"] is False and snap["runtime_line"]["mixed"] is False
