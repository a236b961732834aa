"""Failover of the local appliance under systemd: kill -9 the worker's vLLM under load.

Runs the real local pair (vLLM CPU build) with the project's own units in a throwaway
systemd-nspawn container (tests/systemd/nspawn_container.py; root, systemd-container), puts
a bounded load of real completions on the head's API (loopback), kills the worker's vLLM,
and prints:
  - detection: seconds from the kill until the head leaves `serving`
  - back to serving: seconds from the kill until both nodes serve and a completion succeeds
  - the load's requests: completed, explicit errors (HTTP error or refused/reset connection),
    hung (no answer within --hang-s), silently dropped (HTTP 200 without a completion)

    sudo .venv/bin/python benchmarks/failover.py [--clients 4] [--json]
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
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "systemd"))

from appliance import Appliance, install  # noqa: E402
from nspawn_container import Container, missing_requirements  # noqa: E402

from dspark.local import HEAD_NAME, SERVED_NAME, WORKER_NAME  # noqa: E402

COMPLETED, HTTP_ERROR, CONN_ERROR, HUNG, DROPPED = "completed", "http_error", "connection_error", "hung", "dropped"


@dataclass
class Outcome:
    start: float  # seconds relative to the kill (negative: before it)
    end: float
    kind: str
    detail: str = ""


@dataclass
class Report:
    clients: int
    hang_s: float
    detection_s: float | None = None
    back_to_serving_s: float | None = None
    pair_start_s: float | None = None
    counts: dict[str, int] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)
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


def load(app: Appliance, stop: threading.Event, t_kill: list[float], out: list[Outcome], hang_s: float,
         max_tokens: int) -> None:
    while not stop.is_set():
        t0 = time.monotonic()
        kind, detail = one_request(app.api_url, hang_s, max_tokens)
        t1 = time.monotonic()
        ref = t_kill[0] if t_kill else t1
        out.append(Outcome(t0 - ref, t1 - ref, kind, detail))
        if kind != COMPLETED:
            time.sleep(0.2)  # a down API answers at once; do not spin


def run(clients: int, warmup_s: float, hang_s: float, max_tokens: int, recover_s: float,
        progress=lambda msg: print(msg, file=sys.stderr, flush=True)) -> Report:
    report = Report(clients=clients, hang_s=hang_s)
    with Container() as box:
        app = install(box)
        report.user_note = app.user_note
        progress("starting the pair: systemctl start dspark-head ...")
        t = time.monotonic()
        r = box.systemctl("start", "dspark-head", timeout=900)
        if r.returncode != 0:
            raise RuntimeError(r.stderr + app.diagnose())
        app.wait_serving(120)
        report.pair_start_s = round(time.monotonic() - t, 1)
        progress(f"serving after {report.pair_start_s} s; load: {clients} clients, {warmup_s:g} s before the kill")
        stop, t_kill, outcomes = threading.Event(), [], []
        threads = [threading.Thread(target=load, args=(app, stop, t_kill, outcomes, hang_s, max_tokens), daemon=True)
                   for _ in range(clients)]
        for th in threads:
            th.start()
        try:
            time.sleep(warmup_s)
            pid = app.state(WORKER_NAME)["vllm_pid"]
            t_kill.append(time.monotonic())
            app.kill("KILL", pid)
            progress(f"killed the worker's vLLM (pid {pid} in the container)")
            while time.monotonic() - t_kill[0] < 60:
                s = app.state(HEAD_NAME, timeout=1.0)
                if s is None or s["state"] != "serving":
                    report.detection_s = round(time.monotonic() - t_kill[0], 2)
                    break
                time.sleep(0.1)
            progress(f"detected after {report.detection_s} s; waiting for the pair to serve again")
            app.wait_serving(recover_s)
            report.back_to_serving_s = round(time.monotonic() - t_kill[0], 1)
            progress(f"serving again {report.back_to_serving_s} s after the kill; load runs {warmup_s:g} s more")
            time.sleep(warmup_s)
        finally:
            stop.set()
            for th in threads:
                th.join(timeout=hang_s + 10)
            box.systemctl("stop", "dspark-head", "dspark-worker", timeout=200)
    report.counts = dict(Counter(o.kind for o in outcomes))
    report.errors = dict(Counter(f"{o.kind}: {o.detail}" for o in outcomes if o.kind != COMPLETED))
    return report


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=4, help="concurrent clients (default 4)")
    ap.add_argument("--warmup-s", type=float, default=15, help="load before the kill and after recovery (s)")
    ap.add_argument("--hang-s", type=float, default=60, help="a request without an answer this long is hung (s)")
    ap.add_argument("--max-tokens", type=int, default=16, help="tokens per request (default 16)")
    ap.add_argument("--recover-s", type=float, default=600, help="give up waiting for recovery after (s)")
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    a = ap.parse_args()
    why = missing_requirements()
    if why:
        print(f"failover: {why}", file=sys.stderr)
        return 2
    rep = run(a.clients, a.warmup_s, a.hang_s, a.max_tokens, a.recover_s)
    if a.json:
        print(json.dumps(asdict(rep), indent=2))
        return 0
    total = sum(rep.counts.values())
    print(f"pair start (systemctl start dspark-head): {rep.pair_start_s} s")
    print(f"detection after the worker kill:          {rep.detection_s} s")
    print(f"back to serving after the kill:           {rep.back_to_serving_s} s")
    print(f"requests ({rep.clients} clients, {total} in all):")
    for kind in (COMPLETED, HTTP_ERROR, CONN_ERROR, HUNG, DROPPED):
        print(f"  {kind:<17} {rep.counts.get(kind, 0)}")
    for what, n in sorted(rep.errors.items(), key=lambda kv: -kv[1]):
        print(f"    {n:>5}  {what}")
    if rep.user_note:
        print(f"note: {rep.user_note}")
    return 0 if not (rep.counts.get(HUNG) or rep.counts.get(DROPPED)) else 1


if __name__ == "__main__":
    sys.exit(main())
