"""The page in Debian's headless Chromium against the real local pair (the shared one) under a bounded
load. A worker killed shows failed within 5 s: tests/local/test_no_orphans.py, on the pair that kill breaks."""

from __future__ import annotations

import dataclasses
import re
import time

import pytest

from dspark.config import validate as config
from dspark.config.validate import load
from dspark.dashboard import collector as C
from dspark.dashboard import server as S
from tests.harness.browser import wait_for
from tests.harness.dashboard import DashboardProcess, Load

pytestmark = [pytest.mark.pair, pytest.mark.browser]

NUMBER = re.compile(r"^-?[\d,]+(\.\d+)?( ?(ms|s|%|°C|W|min|h))?$")
VLLM_PANELS = ("throughput", "tokens", "requests", "latency")


# A latency percentile from vLLM's buckets: one figure, or the range the buckets prove ("≤ 44.2 ms",
# "10.0–25.0 ms"), "*" for a median proven above the mean (rates.quantile_range).
QUANTILE = re.compile(r"^(≤ |> )?(\d+\.\d+–)?\d+\.\d+ (ms|s)( \*)?$")


def is_number(text: str) -> bool:
    return bool(NUMBER.match(text.strip()))


def is_figure(text: str) -> bool:
    return is_number(text) or bool(QUANTILE.match(text.strip()))


def live(page: dict) -> bool:
    """Every panel shows live numbers (spec decode: 'off', the local pair has none)."""
    p = page["panels"]
    if page["pair"] != "SERVING" or page["version"] != "0.28.0" or page["lines"] < 1:
        return False
    if not all(p.get(name) and all(is_figure(t) for t in p[name]) for name in VLLM_PANELS):
        return False
    decode_now = float(p["throughput"][0].replace(",", ""))
    if decode_now <= 0 or p.get("spec_decode") != ["off"] * 3:
        return False
    nodes = page["nodes"]
    if sorted(nodes) != ["local-head", "local-worker"]:
        return False
    for n in nodes.values():
        if n["state"] != "serving" or not all(is_number(n[k]) for k in ("restarts", "vllm_pid", "uptime")):
            return False
        # no GPU or NVMe on this machine: "n/a"; a number where there is one
        if not all(n[k] == "n/a" or is_number(n[k]) for k in ("gpu_temp", "gpu_power", "gpu_util", "nvme_temp")):
            return False
    return True


@pytest.fixture
def dashboard_of(tmp_path):
    procs = []

    def start(pair) -> DashboardProcess:
        d = DashboardProcess(pair.cluster_file, tmp_path / f"dashboard-{len(procs)}.log")
        procs.append(d)
        d.wait_ready()
        return d

    yield start
    for d in procs:
        d.stop()


def test_every_panel_live_under_load(local_pair, dashboard_of, browser, artifacts_dir):
    dash = dashboard_of(local_pair)
    with Load(local_pair.api_url, concurrency=2, max_tokens=32, max_requests=300, max_s=120) as load:
        browser.get(dash.url)
        page = wait_for(browser, live, timeout=60)
        time.sleep(2)  # a little history in the chart
        browser.save_screenshot(str(artifacts_dir / "dashboard-live.png"))
    assert load.ok > 0 and load.failed == 0
    assert page["banner"] is None
    # Which proof of life the head used last, and when; a worker has none of its own (the head's covers it).
    assert re.fullmatch(r"(progress|probe), \d+ s ago", page["nodes"]["local-head"]["liveness"]), page["nodes"]
    assert page["nodes"]["local-worker"]["liveness"] == "via the head"  # only the head runs liveness rounds
    assert float(page["panels"]["tokens"][1].replace(",", "")) > 0  # generated tokens
    # the runtime line the real supervisors report: the cluster file's, on every card, nothing marked
    line = config.load(local_pair.cluster_file).serving.runtime_line  # (`load` is the Load here)
    assert {n["runtime_line"] for n in page["nodes"].values()} == {line} and page["runtimeLine"] == line, page
    assert page["otherLine"] == [] and page["switching"] is None


def test_unavailable_metrics_shown_then_recovered(local_pair, browser, metrics_stand_in, artifacts_dir):
    """Malformed, then unreachable /metrics: the banner says so and the cells show '—', never a crash; the
    nodes stay live (their agents are the real pair's)."""
    metrics_stand_in.relay_url = local_pair.api_url  # first the real pair's metrics, relayed
    targets = dataclasses.replace(C.Targets.from_cluster(load(local_pair.cluster_file)),
                                  api_url=metrics_stand_in.url)
    col = C.Collector(targets).start()
    srv = S.DashboardServer("127.0.0.1", 0, col).start()
    try:
        browser.get(srv.url)
        wait_for(browser, lambda p: all(is_number(t) for t in p["panels"].get("tokens", [""])), timeout=20)

        metrics_stand_in.relay_url, metrics_stand_in.text = None, "vllm:generation_tokens_total{ 12 oops\n"
        page = wait_for(browser, lambda p: p["banner"] is not None and "malformed" in p["banner"], timeout=10)
        for name in VLLM_PANELS + ("spec_decode",):  # the banner says why; the cells stay quiet
            assert set(page["panels"][name]) == {"—"}, (name, page["panels"][name])
        assert page["pair"] == "NOT SERVING"
        assert {n["state"] for n in page["nodes"].values()} == {"serving"}
        browser.save_screenshot(str(artifacts_dir / "dashboard-metrics-malformed.png"))

        metrics_stand_in.relay_url = local_pair.api_url
        wait_for(browser, lambda p: p["banner"] is None and all(is_number(t) for t in p["panels"]["tokens"]),
                 timeout=10)

        metrics_stand_in.close()  # nothing listens any more
        page = wait_for(browser, lambda p: p["banner"] is not None and "unreachable" in p["banner"], timeout=10)
        assert set(page["panels"]["throughput"]) == {"—"}
        assert col._thread.is_alive()
    finally:
        srv.stop()
        col.stop()
