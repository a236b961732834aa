#!/usr/bin/env python3
"""Decode throughput with and without the dashboard open, side by side in one run.

One steady decode load (concurrent completions with exact lengths) runs for the whole
benchmark. Windows alternate between the two conditions in an ABBA order, so that a slow
drift of the machine falls on both equally:

  without   no `dspark dashboard` process at all
  with      `dspark dashboard` running (its collector polls vLLM's /metrics and both agents
            at 1 Hz) and a client that has the page open: a 1 Hz poller of its JSON endpoint
            (--client poller, default) or headless Chromium showing the page (--client browser)

Decode throughput in a window is the change of vLLM's own `vllm:generation_tokens` counter over
the window's duration, read at its start and end in both conditions alike.

  .venv/bin/python -m benchmarks.dashboard_overhead                 # starts a local pair itself
  .venv/bin/python -m benchmarks.dashboard_overhead --cluster /etc/dspark/cluster.toml

Target: the dashboard costs under 2% of decode throughput.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

from tests.harness.dashboard import DashboardProcess  # noqa: E402  (`dspark dashboard`, as the tests run it)
from tests.harness.pair import start_pair  # noqa: E402  (`dspark local up` on free loopback ports)

TARGET_PCT = 2.0


def generation_tokens(api_url: str) -> float:
    from dspark.engine import facts as F
    from dspark.engine.metrics import parse

    with urllib.request.urlopen(api_url + F.METRICS, timeout=10) as r:
        return parse(r.read().decode(), at=time.monotonic()).counters[F.GENERATION_TOKENS]


# ----------------------------------------------------------------------------- load

class DecodeLoad:
    def __init__(self, api_url: str, model: str, concurrency: int, prompt_len: int, max_tokens: int,
                 max_s: float):
        self.api_url, self.model = api_url, model
        self.prompt_len, self.max_tokens = prompt_len, max_tokens
        self.deadline = time.monotonic() + max_s  # bounded whatever happens
        self.stop_event = threading.Event()
        self.ok = self.failed = 0
        self.threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(concurrency)]

    def _client(self, i: int) -> None:
        n = 0
        while not self.stop_event.is_set() and time.monotonic() < self.deadline:
            n += 1
            prompt = [(i * 1009 + n * 31 + k) % 4000 + 2 for k in range(self.prompt_len)]
            body = json.dumps({"model": self.model, "prompt": prompt, "max_tokens": self.max_tokens,
                               "ignore_eos": True, "temperature": 0}).encode()
            req = urllib.request.Request(self.api_url + "/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=120) as r:
                    r.read()
                self.ok += 1
            except OSError:
                self.failed += 1
                self.stop_event.wait(1.0)

    def start(self) -> DecodeLoad:
        for t in self.threads:
            t.start()
        return self

    def stop(self) -> None:
        self.stop_event.set()
        for t in self.threads:
            t.join(timeout=150)


# ----------------------------------------------------------------------------- the dashboard

def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class OpenDashboard:
    """`dspark dashboard` (the real command) plus one client with the page open."""

    def __init__(self, cluster_file: Path, client: str, log: Path):
        self.dash = DashboardProcess(cluster_file, log)
        self.url = self.dash.url
        self.client = client
        self.stop_event = threading.Event()
        self.polls = 0
        self.driver = None
        self.profile = None
        try:
            self.dash.wait_ready(timeout=60)
        except RuntimeError as e:
            self.dash.stop()
            raise SystemExit(str(e)) from None
        if client == "browser":
            self._open_browser()
        else:
            self.thread = threading.Thread(target=self._poll, daemon=True)
            self.thread.start()

    def _poll(self) -> None:
        while not self.stop_event.wait(1.0):
            try:
                with urllib.request.urlopen(self.url + "/api/v1/snapshot", timeout=5) as r:
                    r.read()
                self.polls += 1
            except OSError:
                pass

    def _open_browser(self) -> None:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service

        self.profile = tempfile.mkdtemp(prefix="dspark-bench-chromium-")
        opts = webdriver.ChromeOptions()
        opts.binary_location = "/usr/bin/chromium"
        for f in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-dev-shm-usage", "--user-data-dir=" + self.profile):
            opts.add_argument(f)
        self.driver = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=opts)
        self.driver.get(self.url)

    def cpu_seconds(self) -> float:
        return cpu_seconds(self.dash.proc.pid)

    def close(self) -> None:
        self.stop_event.set()
        if self.driver is not None:
            self.driver.quit()
        if self.profile:
            import shutil

            shutil.rmtree(self.profile, ignore_errors=True)
        self.dash.stop()


# ----------------------------------------------------------------------------- the run

def vllm_api_pid(cluster) -> int | None:
    from dspark.node.agent_client import agent_state

    return (agent_state(cluster.head.agent_url) or {}).get("vllm_pid")


def idle_cpu_cost(cluster, cluster_file: Path, client: str, seconds: float, log: Path) -> dict:
    """With no decode load: CPU share of vLLM's API server process without and with the
    dashboard open (process CPU time barely depends on what else runs on the machine)."""
    pid = vllm_api_pid(cluster)
    if not pid:
        return {}
    out = {}
    for cond in ("without", "with"):
        dash = OpenDashboard(cluster_file, client, log) if cond == "with" else None
        try:
            time.sleep(2)
            c0, t0 = cpu_seconds(pid), time.monotonic()
            d0 = dash.cpu_seconds() if dash else 0.0
            time.sleep(seconds)
            wall = time.monotonic() - t0
            out[f"vllm_api_{cond}"] = (cpu_seconds(pid) - c0) / wall
            if dash:
                out["dashboard"] = (dash.cpu_seconds() - d0) / wall
        finally:
            if dash:
                dash.close()
    return out


def measure(api_url: str, seconds: float) -> float:
    t0, g0 = time.monotonic(), generation_tokens(api_url)
    time.sleep(seconds)
    t1, g1 = time.monotonic(), generation_tokens(api_url)
    return (g1 - g0) / (t1 - t0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cluster", type=Path, help="cluster file of a running pair (default: start a local pair)")
    ap.add_argument("--model", help="served model name (default: from the cluster file)")
    ap.add_argument("--client", choices=("poller", "browser"), default="poller")
    ap.add_argument("--rounds", type=int, default=4, help="ABBA rounds (each: one window of each condition)")
    ap.add_argument("--seconds", type=float, default=20.0, help="length of one measuring window")
    ap.add_argument("--settle", type=float, default=3.0, help="seconds between a switch and its window")
    ap.add_argument("--warmup", type=float, default=15.0)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args(argv)
    from dspark.config.validate import load

    tmp = Path(tempfile.mkdtemp(prefix="dspark-dash-bench-"))
    pair = None
    if args.cluster is None:
        print("starting a local pair (dspark local up) ...", flush=True)
        pair = start_pair(tmp / "pair")
        cluster_file = pair.cluster_file
    else:
        cluster_file = args.cluster
    cluster = load(cluster_file)
    api_url = cluster.head.api_url
    model = args.model or cluster.model.served_name
    per_window = args.settle + args.seconds
    budget = args.warmup + 2 * args.rounds * (per_window + 10) + 60
    load_ = DecodeLoad(api_url, model, args.concurrency, args.prompt_len, args.max_tokens, budget).start()
    results: dict[str, list[float]] = {"without": [], "with": []}
    idle: dict = {}
    cpu_share: list[float] = []
    try:
        print(f"decode load: {args.concurrency} concurrent completions, prompt {args.prompt_len}, "
              f"{args.max_tokens} tokens each; warm-up {args.warmup:g} s", flush=True)
        time.sleep(args.warmup)
        for r in range(args.rounds):
            order = ("without", "with") if r % 2 == 0 else ("with", "without")
            for cond in order:
                dash = OpenDashboard(cluster_file, args.client, tmp / "dashboard.log") if cond == "with" else None
                try:
                    time.sleep(args.settle)
                    c0, t0 = (dash.cpu_seconds(), time.monotonic()) if dash else (0.0, 0.0)
                    tps = measure(api_url, args.seconds)
                    if dash:
                        cpu_share.append((dash.cpu_seconds() - c0) / (time.monotonic() - t0))
                finally:
                    if dash:
                        dash.close()
                results[cond].append(tps)
                print(f"  round {r + 1} {cond:>7}: {tps:8.2f} tok/s", flush=True)
        load_.stop()
        idle = idle_cpu_cost(cluster, cluster_file, args.client, args.seconds, tmp / "dashboard.log")
    finally:
        load_.stop()
        if pair is not None:
            print("stopping the local pair ...", flush=True)
            pair.stop(timeout=90)

    wo, wi = statistics.mean(results["without"]), statistics.mean(results["with"])
    overhead = (wo - wi) / wo * 100
    # per round: the paired difference, so a drift of the machine between rounds cancels
    paired = [(a - b) / a * 100 for a, b in zip(results["without"], results["with"], strict=True)]
    spread = statistics.stdev(paired) if len(paired) > 1 else float("nan")
    print()
    print(f"{'round':>5}  {'without':>10}  {'with':>10}  {'overhead':>9}")
    for i, (a, b, p) in enumerate(zip(results["without"], results["with"], paired, strict=True)):
        print(f"{i + 1:>5}  {a:>10.2f}  {b:>10.2f}  {p:>8.2f}%")
    print(f"{'mean':>5}  {wo:>10.2f}  {wi:>10.2f}  {overhead:>8.2f}%   (decode tok/s; paired stdev {spread:.2f} pts)")
    print(f"dashboard process CPU while open: {statistics.mean(cpu_share) * 100:.2f}% of one core "
          f"(client: {args.client}); requests ok {load_.ok}, failed {load_.failed}")
    if idle:
        print(f"idle pair, {args.seconds:g} s each: vLLM API server CPU {idle['vllm_api_without'] * 100:.2f}% of one "
              f"core without the dashboard, {idle['vllm_api_with'] * 100:.2f}% with; the dashboard process "
              f"{idle['dashboard'] * 100:.2f}%")
    stderr = spread / len(paired) ** 0.5 if len(paired) > 1 else float("nan")
    if not stderr <= TARGET_PCT:
        verdict = (f"is INCONCLUSIVE here: the machine's noise (standard error {stderr:.1f} pts over "
                   f"{len(paired)} rounds) is larger than the {TARGET_PCT:g}% target")
    else:
        verdict = ("meets" if overhead < TARGET_PCT else "misses") + f" the target of < {TARGET_PCT:g}%"
    print(f"overhead {overhead:.2f}% {verdict}")
    if args.json:
        args.json.write_text(json.dumps({"without_tps": results["without"], "with_tps": results["with"],
                                         "overhead_pct": overhead, "paired_pct": paired,
                                         "dashboard_cpu_share": cpu_share, "idle_cpu": idle,
                                         "client": args.client,
                                         "config": vars(args) | {"json": str(args.json),
                                                                 "cluster": str(args.cluster)}}, indent=2))
    return 0 if load_.failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
