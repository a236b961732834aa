"""A real Prometheus (Debian's `prometheus`, .ci/setup --system) scrapes the real local pair with
the scrape configuration dspark.monitoring writes for the pair's cluster file (the one the NixOS
module writes for the same file: tests/nix/test_module_prometheus.py). Through Prometheus' HTTP
API, PromQL returns the pair's decode throughput (vLLM's own generation_tokens_total) and each
node's state, and every query of the Grafana dashboard runs and returns data.

Prometheus runs on loopback (a free port, its own storage directory under the test's temporary
directory) and is stopped by its PID in the fixture's teardown, whatever the test did. The answers
are kept in test-artifacts/prometheus-pair.json."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from dspark import monitoring
from dspark.config import validate as config
from dspark.local import cluster as L

pytestmark = pytest.mark.pair

SCRAPE_INTERVAL = "1s"
WINDOW = "30s"  # the rate window of these queries ($__rate_interval in Grafana)
DECODE = f'sum(rate(vllm:generation_tokens_total{{job="{monitoring.JOB_VLLM}"}}[{WINDOW}]))'
STATES = f'dspark_node_state{{job="{monitoring.JOB_AGENT}"}} == 1'


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Prometheus:
    def __init__(self, url: str, proc: subprocess.Popen, log: Path):
        self.url, self.proc, self.log = url, proc, log

    def get(self, path: str, **params) -> dict:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        with urllib.request.urlopen(f"{self.url}{path}{query}", timeout=10) as r:
            return json.loads(r.read())

    def query(self, expr: str) -> list[dict]:
        out = self.get("/api/v1/query", query=expr)
        assert out["status"] == "success", out
        return out["data"]["result"]


@pytest.fixture
def prometheus(local_pair, tmp_path):
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("Debian's prometheus is not installed (.ci/setup --system installs it)")
    cluster = config.load(local_pair.cluster_file)
    cfg = {"global": {"scrape_interval": SCRAPE_INTERVAL, "scrape_timeout": SCRAPE_INTERVAL},
           "scrape_configs": monitoring.scrape_configs(cluster, scrape_interval=SCRAPE_INTERVAL)}
    (tmp_path / "prometheus.yml").write_text(json.dumps(cfg, indent=2))  # JSON is YAML
    port = free_port()
    log = tmp_path / "prometheus.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [binary, f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}"],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    prom = Prometheus(f"http://127.0.0.1:{port}", proc, log)
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, f"prometheus exited with {proc.returncode}:\n{log.read_text()}"
            try:
                with urllib.request.urlopen(prom.url + "/-/ready", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, f"prometheus not ready after 90 s:\n{log.read_text()}"
            time.sleep(0.5)
        yield prom
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)


def completions(api_url: str, n: int, max_tokens: int = 16) -> int:
    """n completions, one after another; the tokens generated."""
    generated = 0
    for i in range(n):
        body = json.dumps({"model": L.SERVED_NAME, "prompt": [1, 2, 3, 4 + i], "max_tokens": max_tokens,
                           "ignore_eos": True}).encode()
        req = urllib.request.Request(api_url + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            generated += json.loads(r.read())["usage"]["completion_tokens"]
    return generated


def until(what: str, check, timeout_s: float = 120.0, every_s: float = 1.0):
    """check() until it returns a true value, at most timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = check()
        if got:
            return got
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s:.0f} s (last: {got!r})"
        time.sleep(every_s)


def test_prometheus_scrapes_the_pair_decode_throughput_and_node_states(local_pair, prometheus, artifacts_dir):
    # Every target up: the head's vLLM and both agents, as the scrape configuration names them.
    def targets_up():
        active = prometheus.get("/api/v1/targets")["data"]["activeTargets"]
        return active if len(active) == 3 and all(t["health"] == "up" for t in active) else None
    active = until("all three targets up", targets_up, 60)
    assert sorted((t["labels"]["job"], t["labels"]["node"]) for t in active) == [
        (monitoring.JOB_AGENT, "local-head"), (monitoring.JOB_AGENT, "local-worker"),
        (monitoring.JOB_VLLM, "local-head")]

    generated = completions(local_pair.api_url, 6)
    assert generated == 6 * 16

    def decode():
        result = prometheus.query(DECODE)
        return result if result and float(result[0]["value"][1]) > 0 else None
    (decode_sample,) = until("decode throughput above 0", decode, 60)
    decode_tps = float(decode_sample["value"][1])

    states = until("both nodes' states", lambda: (r := prometheus.query(STATES)) and len(r) == 2 and r, 30)
    by_node = {s["metric"]["node"]: s["metric"]["state"] for s in states}
    assert by_node == {"local-head": "serving", "local-worker": "serving"}
    assert {s["metric"]["role"] for s in states} == {"head", "worker"}

    # The probe's latency is served while the last proof of life was a probe, which the head sends
    # only while the engine is idle (every liveness_interval_s): after the completions, one comes.
    latency = f'dspark_node_liveness_latency_seconds{{job="{monitoring.JOB_AGENT}"}}'
    until("a liveness probe after the completions", lambda: prometheus.query(latency), 90)

    # Every query of the dashboard runs, and each panel's returns data (the memory panel where
    # the agents report memory; the restarts annotation is empty without a restart).
    memory_served = bool(prometheus.query(f'dspark_node_memory_total_bytes{{job="{monitoring.JOB_AGENT}"}}'))
    answers = {}
    for title, expr in monitoring.dashboard_queries():
        result = prometheus.query(expr.replace("$__rate_interval", WINDOW))
        answers[expr] = [{"metric": r["metric"], "value": r["value"][1]} for r in result]
        if title.startswith("annotation") or (title == "Memory per node" and not memory_served):
            continue
        assert result, f"{title}: {expr} returned nothing"
    node_state = monitoring.state_number_expr().replace("$__rate_interval", WINDOW)
    assert {r["metric"]["node"]: r["value"] for r in answers[node_state]} == \
        {"local-head": "5", "local-worker": "5"}  # 5: serving, dspark.node.states' fifth

    print(f"\n{DECODE} -> {decode_tps:.3f} tokens/s\n{STATES} -> {by_node}")
    (artifacts_dir / "prometheus-pair.json").write_text(json.dumps({
        "prometheus": subprocess.run(["prometheus", "--version"], capture_output=True, text=True,
                                     timeout=30).stdout.splitlines()[0],
        "decode": {"query": DECODE, "tokens_per_s": decode_tps, "generated_in_test": generated},
        "states": {"query": STATES, "answer": by_node},
        "dashboard": answers,
    }, indent=2) + "\n")
