"""Control-plane targets, measured side by side in one run:

1. the supervised pair (`dspark serve` on both nodes) is ready within 1.05x the time the same
   two vLLM commands take when started by hand (worker first, head once the worker is in
   the rendezvous; ready = the first successful 1-token completion);
2. readiness is reported (READY=1 on a real notify socket) within 1 s of vLLM first
   answering: its first successful 1-token completion as seen by an outside prober (the
   lag after /health first answering 200 is printed too; vLLM's first completion after
   /health takes seconds on CPU, on its own);
3. `dspark --help` returns in under 0.3 s.

Runs alternate (hand, supervised, hand, supervised, ...) so that load from anything else on
the machine falls on both alike. `--nodes 2,4` measures the local appliance at each node count
(tensor parallel over all of them: the workers first, the head once every worker is in the
rendezvous) and prints the figures side by side. Usage:

    .venv/bin/python -m benchmarks.startup [--rounds 2] [--nodes 2,4] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from dspark.config import validate as C  # noqa: E402
from dspark.local import cluster as L  # noqa: E402
from dspark.node.launch import render  # noqa: E402
from dspark.node.notify import child_env  # noqa: E402
from tests.harness.pair import node_counts_arg, pick_ports  # noqa: E402  (shared with the tests)

TIMEOUT_S = 900


def http_ok(url: str, data: dict | None = None, timeout: float = 2.0) -> bool:
    body = None if data is None else json.dumps(data).encode()
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status == 200
    except OSError:
        return False


def completion_ok(api: str) -> bool:
    return http_ok(api + "/v1/completions", {"model": L.SERVED_NAME, "prompt": [0], "max_tokens": 1}, 10)


class HealthWatch(threading.Thread):
    """Records when /health first answers 200 (polled every 20 ms), then when a 1-token
    completion first succeeds (tried back to back)."""

    def __init__(self, api: str):
        super().__init__(daemon=True)
        self.api, self.first_ok, self.first_completion, self.stop = api, None, None, False

    def run(self):
        deadline = time.monotonic() + TIMEOUT_S
        while not self.stop and self.first_ok is None and time.monotonic() < deadline:
            if http_ok(self.api + "/health", timeout=0.5):
                self.first_ok = time.monotonic()
            time.sleep(0.02)
        while not self.stop and self.first_completion is None and time.monotonic() < deadline:
            if completion_ok(self.api):
                self.first_completion = time.monotonic()
            time.sleep(0.02)


def kill_group(p: subprocess.Popen, grace: float = 20) -> None:
    if p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            p.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    p.wait()


def by_hand(workdir: Path, nodes: int) -> float:
    """The rendered vLLM commands, started as a person would: each worker (once the one before
    is in the rendezvous), then the head."""
    cluster = C.load(L.prepare(workdir, pick_ports(nodes), nodes=nodes))
    procs = []
    try:
        t0 = time.monotonic()
        for node in (*cluster.workers, cluster.head):
            launch = render(cluster, node)
            log = open(workdir / f"hand-{node.name}.log", "w")
            procs.append(subprocess.Popen(launch.argv, env={**child_env(dict(os.environ)), **launch.env},
                                          stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
            log.close()
            if not node.is_head:  # wait for the worker's rendezvous line, as the runbook says
                deadline = time.monotonic() + TIMEOUT_S
                while "headless multiproc executor" not in (workdir / f"hand-{node.name}.log").read_text():
                    if time.monotonic() > deadline or procs[-1].poll() is not None:
                        raise RuntimeError("worker did not reach the rendezvous")
                    time.sleep(0.05)
        deadline = time.monotonic() + TIMEOUT_S
        api = cluster.head.api_url
        while not (http_ok(api + "/health", timeout=0.5) and completion_ok(api)):
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                raise RuntimeError(f"hand-started {nodes}-node appliance never served")
            time.sleep(0.05)
        return time.monotonic() - t0
    finally:
        for p in reversed(procs):
            kill_group(p)


def supervised(workdir: Path, nodes: int) -> tuple[float, float, float]:
    """`dspark serve` on every node, started together; returns (ready time, READY lag after the
    first outside completion, READY lag after /health first answered)."""
    cluster_file = L.prepare(workdir, pick_ports(nodes), nodes=nodes)
    cluster = C.load(cluster_file)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(workdir / "head.sock"))
    sock.settimeout(0.5)
    procs = []
    watch = HealthWatch(cluster.head.api_url)
    try:
        t0 = time.monotonic()
        for node in (*cluster.workers, cluster.head):
            env = dict(os.environ)
            if node.is_head:
                env["NOTIFY_SOCKET"] = str(workdir / "head.sock")
            log = open(workdir / f"sup-{node.name}.log", "w")
            procs.append(subprocess.Popen([sys.executable, "-m", "dspark", "serve", "--config", str(cluster_file),
                                           "--node", node.name], env=env, stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True))
            log.close()
        watch.start()
        deadline = time.monotonic() + TIMEOUT_S
        while time.monotonic() < deadline:
            if any(p.poll() is not None for p in procs):
                raise RuntimeError("a supervisor exited")
            try:
                msg = sock.recv(4096).decode()
            except TimeoutError:
                continue
            if msg.startswith("READY=1"):
                t_ready = time.monotonic()
                watch.join(timeout=30)
                nan = float("nan")
                lag = t_ready - watch.first_completion if watch.first_completion else nan
                health_lag = t_ready - watch.first_ok if watch.first_ok else nan
                return t_ready - t0, lag, health_lag
        raise RuntimeError(f"supervised {nodes}-node appliance never ready")
    finally:
        watch.stop = True
        for p in reversed(procs):
            kill_group(p, grace=40)
        sock.close()


def help_time(n: int = 10) -> list[float]:
    exe = shutil.which("dspark") or str(Path(sys.executable).parent / "dspark")
    times = []
    for _ in range(n):
        t0 = time.monotonic()
        subprocess.run([exe, "--help"], check=True, capture_output=True)
        times.append(time.monotonic() - t0)
    return times


def measure(nodes: int, rounds: int, tmp: Path) -> dict:
    hand, sup, lag, health_lag = [], [], [], []
    for i in range(rounds):
        d = tmp / f"n{nodes}-round{i}"
        (d / "hand").mkdir(parents=True)
        (d / "sup").mkdir()
        hand.append(by_hand(d / "hand", nodes))
        print(f"{nodes} nodes, round {i + 1}: by hand      ready after {hand[-1]:6.1f} s", flush=True)
        t, lg, h = supervised(d / "sup", nodes)
        sup.append(t)
        lag.append(lg)
        health_lag.append(h)
        print(f"{nodes} nodes, round {i + 1}: supervised   ready after {t:6.1f} s  (READY {lg:+.2f} s after vLLM "
              f"first answered a completion, {h:+.2f} s after /health first 200)", flush=True)
    return {"nodes": nodes, "hand_ready_s": hand, "supervised_ready_s": sup,
            "ready_ratio_median": statistics.median(sup) / statistics.median(hand),
            "ready_after_first_completion_s": lag, "ready_after_health_s": health_lag}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2, help="pairs of runs (hand, supervised) per node count")
    ap.add_argument("--nodes", type=node_counts_arg, default=[2], metavar="N[,N]",
                    help="node counts to measure, side by side (default 2; e.g. 2,4)")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory(prefix="dspark-startup-") as tmp:
        per_nodes = [measure(n, args.rounds, Path(tmp)) for n in args.nodes]
    helps = help_time()
    print()
    print(f"{'nodes':>5}  {'by hand (median)':>16}  {'supervised (median)':>19}  {'ratio':>6}  "
          f"{'READY lag (max)':>15}  target")
    for f in per_nodes:
        ratio, worst = f["ready_ratio_median"], max(f["ready_after_first_completion_s"])
        print(f"{f['nodes']:>5}  {statistics.median(f['hand_ready_s']):>14.1f} s  "
              f"{statistics.median(f['supervised_ready_s']):>17.1f} s  {ratio:>6.3f}  {worst:>+13.2f} s  "
              f"ratio <= 1.05 {'OK' if ratio <= 1.05 else 'MISSED'}, lag <= 1 s {'OK' if worst <= 1 else 'MISSED'}")
    worst_health = max(max(f["ready_after_health_s"]) for f in per_nodes)
    print(f"(READY=1 after /health first answered 200: max {worst_health:+.2f} s)")
    print(f"dspark --help: median {statistics.median(helps) * 1000:.0f} ms   "
          f"target < 300 ms   {'OK' if statistics.median(helps) < 0.3 else 'MISSED'}")
    if args.json:
        figures = {"per_nodes": per_nodes, "help_s": helps, "help_median_s": statistics.median(helps)}
        args.json.write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
