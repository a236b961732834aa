"""Failover of the local appliance under systemd: a dead worker, a wedged one, a saturated pair.

Runs the real local pair (vLLM CPU build) with the project's own units in a throwaway
systemd-nspawn container (tests/harness/nspawn_container.py; root, systemd-container), puts
a bounded load of real completions on the head's API (loopback), and for each case prints
detection time and requests lost:
  - kill:       kill -9 the worker's vLLM
  - wedge:      SIGSTOP every process of the worker's vLLM (the collective wedges; /health and
                /metrics keep answering): the head must call it a stall within stall_s
  - saturation: 2 x max_num_seqs clients of long completions for longer than three liveness
                windows: nothing may be detected and nothing lost
For each: detection (seconds from the fault until the head leaves `serving`; none expected
for saturation), back to serving (until both serve and a completion succeeds), and the load's
requests: completed, explicit errors (HTTP error or refused/reset connection), hung (no answer
within --hang-s), silently dropped (HTTP 200 without a completion).

`--nodes 2,4` runs the cases on the pair and then on a four-node ring (head + three workers,
TP=4, each worker an instance of dspark-worker@.service), and prints the figures side by side;
the fault strikes the highest-ranked worker (`--worker-rank` picks another).

    sudo .venv/bin/python -m benchmarks.failover [--case kill --case wedge ...] [--nodes 2,4] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import asdict, dataclass, field

from dspark.local.cluster import HEAD_NAME, SERVED_NAME, node_name  # noqa: E402
from tests.harness.appliance import Appliance, install  # noqa: E402
from tests.harness.nspawn_container import Container, missing_requirements  # noqa: E402
from tests.harness.pair import node_counts_arg  # noqa: E402

COMPLETED, HTTP_ERROR, CONN_ERROR, HUNG, DROPPED = "completed", "http_error", "connection_error", "hung", "dropped"


@dataclass
class Outcome:
    start: float  # monotonic seconds, sent
    end: float    # answered (or given up)
    kind: str
    detail: str = ""


@dataclass
class Report:
    case: str
    clients: int
    hang_s: float
    nodes: int = 2
    victim: str = ""          # the worker the fault struck
    detection_s: float | None = None
    back_to_serving_s: float | None = None
    pair_start_s: float | None = None
    counts: dict[str, int] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)
    in_flight: int = 0        # requests running when the fault struck (saturation: all of them)
    in_flight_lost: int = 0   # of those, the ones that did not complete
    user_note: str = ""


def one_request(api_url: str, hang_s: float, max_tokens: int) -> tuple[str, str]:
    body = json.dumps({"model": SERVED_NAME, "prompt": [1, 2, 3, 4], "max_tokens": max_tokens,
                       "temperature": 0, "ignore_eos": True}).encode()
    req = urllib.request.Request(api_url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=hang_s) as r:
            raw = r.read()
    except urllib.error.HTTPError as e:
        return HTTP_ERROR, f"HTTP {e.code}"
    except TimeoutError:
        return HUNG, f"no answer in {hang_s:g} s"
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        if isinstance(reason, TimeoutError) or "timed out" in str(reason):
            return HUNG, f"no answer in {hang_s:g} s"
        return CONN_ERROR, type(reason).__name__ if not isinstance(reason, str) else reason
    try:
        choice = json.loads(raw)["choices"][0]
        ok = choice.get("finish_reason") is not None
    except (ValueError, KeyError, IndexError, TypeError):
        ok = False
    return (COMPLETED, "") if ok else (DROPPED, raw[:80].decode(errors="replace"))


def load(app: Appliance, stop: threading.Event, out: list[Outcome], hang_s: float,
         max_tokens: int) -> None:
    while not stop.is_set():
        t0 = time.monotonic()
        kind, detail = one_request(app.api_url, hang_s, max_tokens)
        t1 = time.monotonic()
        out.append(Outcome(t0, t1, kind, detail))  # monotonic times; made relative to the fault after it
        if kind != COMPLETED:
            time.sleep(0.2)  # a down API answers at once; do not spin


CASES = ("kill", "wedge", "saturation")


def run_case(app: Appliance, case: str, clients: int, warmup_s: float, hang_s: float, max_tokens: int,
             recover_s: float, progress, victim: str) -> Report:
    sup = app.cluster.supervisor
    if case == "saturation":
        # Twice max_num_seqs long completions, for longer than 3 x (interval + timeout).
        clients = 2 * app.cluster.serving.max_num_seqs
        max_tokens = max(max_tokens, 400)
        warmup_s = max(warmup_s, 3 * (sup.liveness_interval_s + sup.liveness_timeout_s) + 5)
    report = Report(case=case, clients=clients, hang_s=hang_s, user_note=app.user_note, nodes=app.nodes,
                    victim="" if case == "saturation" else victim)
    app.wait_serving(recover_s)
    progress(f"[{case}] load: {clients} clients of {max_tokens} tokens, {warmup_s:g} s before the fault")
    stop, t_fault, outcomes = threading.Event(), [], []
    threads = [threading.Thread(target=load, args=(app, stop, outcomes, hang_s, max_tokens), daemon=True)
               for _ in range(clients)]
    for th in threads:
        th.start()
    try:
        time.sleep(warmup_s)
        t_fault.append(time.monotonic())
        if case == "saturation":
            limit = 0.0  # no fault: the load simply ends; anything detected is a false alarm
        else:
            pid = app.state(victim)["vllm_pid"]
            app.kill("KILL" if case == "kill" else "STOP", pid, group=case == "wedge")
            progress(f"[{case}] {'killed' if case == 'kill' else 'stopped (SIGSTOP)'} {victim}'s vLLM "
                     f"(pid {pid} in the container)")
            limit = 60.0 if case == "kill" else sup.stall_s + 60
        while time.monotonic() - t_fault[0] < limit:
            s = app.state(HEAD_NAME, timeout=1.0)
            if s is None or s["state"] != "serving":
                report.detection_s = round(time.monotonic() - t_fault[0], 2)
                break
            time.sleep(0.1)
        if case != "saturation":
            progress(f"[{case}] detected after {report.detection_s} s; waiting for every node to serve again")
            app.wait_serving(recover_s)
            report.back_to_serving_s = round(time.monotonic() - t_fault[0], 1)
            progress(f"[{case}] serving again {report.back_to_serving_s} s after the fault; "
                     f"load runs {warmup_s:g} s more")
            time.sleep(warmup_s)
    finally:
        stop.set()
        for th in threads:
            th.join(timeout=hang_s + 10)
    if case == "saturation":
        s = app.state(HEAD_NAME, timeout=1.0)
        if s is None or s["state"] != "serving":
            report.detection_s = round(time.monotonic() - t_fault[0], 2)  # a false alarm
    report.counts = dict(Counter(o.kind for o in outcomes))
    report.errors = dict(Counter(f"{o.kind}: {o.detail}" for o in outcomes if o.kind != COMPLETED))
    # In flight at the fault: sent before it and answered (or not) after it. A request that
    # ended before the fault was not hit by it.
    hit = outcomes if case == "saturation" else [o for o in outcomes if o.start <= t_fault[0] < o.end]
    report.in_flight = len(hit)
    report.in_flight_lost = sum(o.kind != COMPLETED for o in hit)
    return report


def run(cases: list[str], clients: int, warmup_s: float, hang_s: float, max_tokens: int, recover_s: float,
        nodes: int = 2, worker_rank: int | None = None,
        progress=lambda msg: print(msg, file=sys.stderr, flush=True)) -> list[Report]:
    reports = []
    victim = node_name(nodes - 1 if worker_rank is None else worker_rank)
    with Container() as box:
        app = install(box, nodes=nodes)
        progress(f"starting {nodes} nodes: systemctl start dspark-head ...")
        t = time.monotonic()
        r = box.systemctl("start", "dspark-head", timeout=900)
        if r.returncode != 0:
            raise RuntimeError(r.stderr + app.diagnose())
        app.wait_serving(120)
        pair_start_s = round(time.monotonic() - t, 1)
        progress(f"serving after {pair_start_s} s")
        try:
            for case in cases:
                rep = run_case(app, case, clients, warmup_s, hang_s, max_tokens, recover_s, progress, victim)
                rep.pair_start_s = pair_start_s
                reports.append(rep)
        finally:
            box.systemctl("stop", *app.units, timeout=200)
    return reports


def print_report(rep: Report) -> bool:
    """One case's figures; True when it went wrong (hung or dropped requests, a false alarm)."""
    total = sum(rep.counts.values())
    print(f"\n== {rep.case}, {rep.nodes} nodes" + (f" (fault on {rep.victim})" if rep.victim else ""))
    print(f"detection after the fault:  {rep.detection_s if rep.detection_s is not None else 'none'}"
          f"{' s' if rep.detection_s is not None else ''}")
    if rep.case != "saturation":
        print(f"back to serving:            {rep.back_to_serving_s} s")
    print(f"requests lost:              {rep.in_flight_lost} of {rep.in_flight} "
          f"{'sent' if rep.case == 'saturation' else 'in flight at the fault'} ({rep.clients} clients)")
    print(f"all requests ({total}, retried every 0.2 s while the API was down):")
    for kind in (COMPLETED, HTTP_ERROR, CONN_ERROR, HUNG, DROPPED):
        print(f"  {kind:<17} {rep.counts.get(kind, 0)}")
    for what, n in sorted(rep.errors.items(), key=lambda kv: -kv[1]):
        print(f"    {n:>5}  {what}")
    bad = bool(rep.counts.get(HUNG) or rep.counts.get(DROPPED))
    return bad or (rep.case == "saturation" and (rep.in_flight_lost > 0 or rep.detection_s is not None))


def print_side_by_side(reports: list[Report]) -> None:
    counts = sorted({r.nodes for r in reports})
    print("\n== side by side (seconds; lost = requests in flight at the fault that did not complete)")
    print(f"{'case':<11} {'figure':<17}" + "".join(f"{f'{n} nodes':>12}" for n in counts))
    for case in dict.fromkeys(r.case for r in reports):
        by = {r.nodes: r for r in reports if r.case == case}
        rows = [("start", lambda r: r.pair_start_s), ("detection", lambda r: r.detection_s)]
        if case != "saturation":
            rows.append(("back to serving", lambda r: r.back_to_serving_s))
        rows.append(("lost", lambda r: f"{r.in_flight_lost}/{r.in_flight}"))
        for label, get in rows:
            cells = "".join(f"{'-' if n not in by or get(by[n]) is None else get(by[n])!s:>12}" for n in counts)
            print(f"{case:<11} {label:<17}{cells}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=4, help="concurrent clients (default 4)")
    ap.add_argument("--warmup-s", type=float, default=15, help="load before the kill and after recovery (s)")
    ap.add_argument("--hang-s", type=float, default=60, help="a request without an answer this long is hung (s)")
    ap.add_argument("--max-tokens", type=int, default=16, help="tokens per request (default 16)")
    ap.add_argument("--recover-s", type=float, default=600, help="give up waiting for recovery after (s)")
    ap.add_argument("--case", action="append", choices=CASES,
                    help="kill, wedge or saturation; repeat for several (default: all three, in that order)")
    ap.add_argument("--nodes", type=node_counts_arg, default=[2], metavar="N[,N]",
                    help="node counts to run the cases at, side by side (default 2; e.g. 2,4)")
    ap.add_argument("--worker-rank", type=int, default=None,
                    help="the worker the fault strikes (default: the highest rank)")
    ap.add_argument("--json", action="store_true", help="print the reports as JSON")
    a = ap.parse_args()
    if a.worker_rank is not None and not all(1 <= a.worker_rank < n for n in a.nodes):
        print(f"failover: --worker-rank {a.worker_rank} is not a worker of every node count "
              f"({', '.join(map(str, a.nodes))})", file=sys.stderr)
        return 2
    why = missing_requirements()
    if why:
        print(f"failover: {why}", file=sys.stderr)
        return 2
    reports = [rep for n in a.nodes
               for rep in run(a.case or list(CASES), a.clients, a.warmup_s, a.hang_s, a.max_tokens, a.recover_s,
                              nodes=n, worker_rank=a.worker_rank)]
    if a.json:
        print(json.dumps([asdict(r) for r in reports], indent=2))
        return 0
    bad = False
    for n in a.nodes:
        mine = [r for r in reports if r.nodes == n]
        print(f"\n{n} nodes: start (systemctl start dspark-head): {mine[0].pair_start_s} s")
        for rep in mine:
            bad |= print_report(rep)
    if len(a.nodes) > 1:
        print_side_by_side(reports)
    if reports[0].user_note:
        print(f"note: {reports[0].user_note}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
