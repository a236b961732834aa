"""The collector: ONE thread polls vLLM's /metrics and every node agent once per interval,
keeps a bounded history (dashboard/history.py) and timeline (dashboard/timeline.py), and
renders the JSON snapshot once per round. Every browser client is served those same bytes, so
N open pages cost N small copies, not N scrapes.

Nothing the targets answer can stop the thread: an unreachable or malformed /metrics makes
the vLLM part "unavailable" (available: false, error: why) until a good answer comes back.
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from dspark.config.schema import Cluster
from dspark.dashboard import rates
from dspark.dashboard.agent_fields import line, liveness, memory, rounded, switch
from dspark.dashboard.history import LATENCIES, History
from dspark.dashboard.snapshot_model import UNREACHABLE
from dspark.dashboard.timeline import Timeline
from dspark.engine import facts as F
from dspark.engine.metrics import MetricsError, Scrape, parse
from dspark.net.http import HTTPFailure, request
from dspark.node import hardware
from dspark.node import states as A
from dspark.node.agent_client import AgentAnswer, fetch_state, is_lost

SCHEMA_VERSION = 1
# A node whose service fails exits right away (agent included), so its own "failed" answer is
# rarely there to be seen. An agent that answered before is therefore reported failed when its
# port refuses connections (its supervisor, the unit's main process, is gone), or when it has
# not answered for LOST_AFTER_S (host or network gone: timeouts, so allow a missed round).
LOST_AFTER_S = 2.0
VERSION_REFRESH_S = 30.0


DEFAULT_INTERVAL_S = 1.0  # seconds between polls (`dspark dashboard --interval`)


@dataclass(frozen=True)
class NodeTarget:
    name: str
    rank: int
    role: str
    agent_url: str


@dataclass(frozen=True)
class Targets:
    """What the collector polls: the head's API and each node's agent."""

    api_url: str
    nodes: tuple[NodeTarget, ...]
    local_node: str | None = None  # the node this host is: its GPU/NVMe are read here
    served_name: str | None = None  # the model name clients send (shown on the page)
    liveness_interval_s: float | None = None  # the head's idle 1-token probe period


    @classmethod
    def from_cluster(cls, cluster: Cluster, local_node: str | None = None) -> Targets:
        nodes = tuple(NodeTarget(n.name, n.rank, "head" if n.is_head else "worker", n.agent_url)
                      for n in sorted(cluster.nodes, key=lambda n: n.rank))
        return cls(api_url=cluster.head.api_url.rstrip("/"), nodes=nodes, local_node=local_node,
                   served_name=cluster.model.served_name,
                   liveness_interval_s=cluster.supervisor.liveness_interval_s)


@dataclass
class _NodeMemory:
    last_ok: float | None = None  # monotonic time of the last answer
    last: dict | None = None
    lost: bool = False  # a "lost" event is in the timeline since the agent last answered


class Collector:
    def __init__(self, targets: Targets, *, interval_s: float = DEFAULT_INTERVAL_S, history_len: int = 300,
                 window_s: float = 60.0, api_token: str | None = None, gpu: hardware.Gpu | None = None,
                 hwmon: Path = hardware.HWMON, timeout_s: float | None = None):
        self.targets = targets
        self.interval_s = interval_s
        self.api_token = api_token
        self.timeout_s = timeout_s if timeout_s is not None else max(2.0, 2 * interval_s)
        self.gpu = gpu or hardware.Gpu()
        self.hwmon = hwmon
        self.history = History(history_len)
        self.scrapes: deque[Scrape] = deque(maxlen=max(2, int(window_s / interval_s) + 1))
        # vllm:request_success by finished_reason, one per scrape in self.scrapes (None: not said)
        self.reasons: deque[dict[str, float] | None] = deque(maxlen=self.scrapes.maxlen)
        self.timeline = Timeline()
        self.window_s = window_s
        self.resets = 0
        self.rounds = 0
        self._active = {"decode_tps": [0.0, 0], "prefill_tps": [0.0, 0]}  # sum, samples
        self._last_interval: rates.Interval | None = None
        self._nodes = {n.name: _NodeMemory() for n in targets.nodes}
        self._version: str | None = None
        self._version_at = -VERSION_REFRESH_S
        self._lock = threading.Lock()
        self._snapshot: dict = {}
        self._json = b"{}"
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(max_workers=len(targets.nodes) + 1, thread_name_prefix="dashboard-fetch")
        self._thread = threading.Thread(target=self._run, name="dashboard-collector", daemon=True)
        self._render(time.monotonic(), None, "not polled yet", {})

    # ----------------------------------------------------------------- lifecycle
    def start(self) -> Collector:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.timeout_s + 5)
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _run(self) -> None:
        next_at = time.monotonic()
        while not self._stop.is_set():
            try:
                self.tick()
            except Exception as e:  # noqa: BLE001 (the page must keep updating whatever happens)
                with self._lock:
                    self._snapshot["collector_error"] = f"{type(e).__name__}: {e}"
                    self._json = json.dumps(self._snapshot).encode()
            next_at += self.interval_s
            now = time.monotonic()
            if next_at < now:  # a slow round: skip the missed ticks rather than burst
                next_at = now
            self._stop.wait(next_at - now)

    # ------------------------------------------------------------------- reading
    def snapshot(self) -> dict:
        with self._lock:
            return self._snapshot

    def snapshot_json(self) -> bytes:
        with self._lock:
            return self._json

    # ------------------------------------------------------------------- one round
    def tick(self) -> dict:
        """Poll everything once (concurrently, each with a timeout) and render the snapshot."""
        metrics_f = self._pool.submit(self._fetch_metrics)
        agent_fs = {n.name: self._pool.submit(self._fetch_agent, n.agent_url) for n in self.targets.nodes}
        now = time.monotonic()
        scrape, error, reasons = metrics_f.result()
        agents = {name: f.result() for name, f in agent_fs.items()}
        if scrape is not None:
            if self.scrapes:
                iv = rates.interval(self.scrapes[-1], scrape)
                if iv.reset:
                    self.resets += 1
                    self.scrapes.clear()  # the latency window restarts with the new process
                    self.reasons.clear()
                self._last_interval = iv
                if iv.active:
                    for key in self._active:
                        v = getattr(iv, key)
                        if v:
                            self._active[key][0] += v
                            self._active[key][1] += 1
            self.scrapes.append(scrape)
            self.reasons.append(reasons)
        else:
            self._last_interval = None
        self.rounds += 1
        return self._render(now, scrape, error, agents)

    def _fetch_metrics(self) -> tuple[Scrape | None, str | None, dict[str, float] | None]:
        url = self.targets.api_url + F.METRICS
        try:
            r = request(url, timeout=self.timeout_s, token=self.api_token)
        except HTTPFailure as e:
            return None, f"unreachable: {e}", None
        at = time.monotonic()
        if r.status != 200:
            return None, f"{url}: HTTP {r.status}", None
        text = r.body.decode("utf-8", errors="replace")
        try:
            return parse(text, at), None, rates.finished_by_reason(text)
        except MetricsError as e:
            return None, str(e), None

    def _fetch_agent(self, url: str) -> AgentAnswer:
        return fetch_state(url, timeout=self.timeout_s)

    def _vllm_version(self, agents: dict) -> str | None:
        for n in self.targets.nodes:  # the agents know it already: no extra request to vLLM
            v = (agents[n.name].state or {}).get("vllm_version") if n.name in agents else None
            if v:
                self._version = v
                return v
        now = time.monotonic()
        if now - self._version_at >= VERSION_REFRESH_S:
            self._version_at = now
            try:
                r = request(self.targets.api_url + F.VERSION, timeout=self.timeout_s, token=self.api_token)
                if r.status == 200:
                    self._version = r.json().get("version") or self._version
            except (HTTPFailure, ValueError, AttributeError):
                pass
        return self._version

    # ------------------------------------------------------------------- rendering
    def _node(self, t: NodeTarget, answer: AgentAnswer | None, now: float) -> tuple[dict, dict | None]:
        """The node's part of the snapshot, and the agent's answer that still holds for it (this
        round's, or the last one while a missed round is within grace; None when lost)."""
        mem = self._nodes[t.name]
        s = answer.state if answer else None
        if s is not None:
            mem.last_ok, mem.last = now, s
        last = mem.last or {}
        silent = None if mem.last_ok is None else now - mem.last_ok
        holds: dict | None = None
        if s is not None:
            state, detail, holds = s["state"], s.get("detail", ""), s
        elif mem.last_ok is None:
            state, detail = UNREACHABLE, f"agent {t.agent_url} has not answered"
        elif last.get("state") in (A.STOPPING, A.STOPPED):
            state, detail = A.STOPPED, f"agent gone after it reported {last.get('state')}"
        elif lost := is_lost(answer, last, silent, LOST_AFTER_S):
            state, detail = A.FAILED, lost
        else:
            state, detail, holds = last.get("state", UNREACHABLE), "agent did not answer this round", last
        if s is not None:
            mem.lost = False
            self.timeline.take(t.name, s.get("events"))
        elif state == A.FAILED and mem.last_ok is not None and not mem.lost:
            # The agent is gone without a clean stop: its own ring says nothing more (a kill -9, a
            # crash, a host down), so the timeline says it from here.
            mem.lost = True
            self.timeline.add({"at": round(time.time(), 3), "node": t.name, "kind": "lost", "detail": detail,
                               "by": "dashboard"})
        if isinstance(last.get("hardware"), dict):
            hw, source = last["hardware"], "agent"
        elif t.name == self.targets.local_node:
            hw, source = hardware.read_local(self.gpu, self.hwmon), "local"
        else:
            hw, source = {"gpus": [], "nvme_temperature_c": None}, None
        return {
            "name": t.name, "rank": t.rank, "role": t.role, "agent_url": t.agent_url,
            "runtime_line": line(last.get("runtime_line")), "file_line": line(last.get("file_line")),
            "other_line": False,  # set by _lines, which compares with the head
            "reachable": s is not None, "state": state, "detail": detail,
            "silent_s": rounded(silent, 1) if s is None else 0.0,
            "restarts": last.get("restarts"), "vllm_pid": last.get("vllm_pid"),
            "vllm_version": last.get("vllm_version"), "uptime_s": last.get("uptime_s"),
            "liveness": liveness(last.get("liveness")),
            "hardware": {"source": source, "gpus": hw.get("gpus") or [],
                         "nvme_temperature_c": hw.get("nvme_temperature_c")},
            "memory": memory(last.get("memory")),
        }, holds

    def _lines(self, nodes: list[dict], answers: list[dict | None]) -> dict:
        """Which runtime line the pair runs (the head's), which nodes run another one (marked in
        their card), and the switch under way that the head's agent reports (dspark switch)."""
        head = next((i for i, t in enumerate(self.targets.nodes) if t.role == "head"), None)
        head_answer = answers[head] if head is not None else None
        head_line = line(head_answer.get("runtime_line")) if head_answer is not None else None
        for n, a in zip(nodes, answers, strict=True):
            theirs = line(a.get("runtime_line")) if a is not None else None
            n["other_line"] = n["role"] != "head" and None not in (head_line, theirs) and theirs != head_line
        return {"head": head_line, "mixed": any(n["other_line"] for n in nodes),
                "switch": switch(head_answer.get("line_switch")) if head_answer is not None else None}

    def _render(self, now: float, scrape: Scrape | None, error: str | None, agents: dict) -> dict:
        iv = self._last_interval
        nodes, answers = [], []
        for t in self.targets.nodes:
            node, holds = self._node(t, agents.get(t.name), now)
            nodes.append(node)
            answers.append(holds)
        lines = self._lines(nodes, answers)

        def active_avg(key: str) -> float | None:
            total, n = self._active[key]
            return total / n if n else None

        vllm: dict = {"available": scrape is not None, "error": error, "url": self.targets.api_url,
                      "version": self._vllm_version(agents) if self.rounds else None,
                      "counter_resets": self.resets}
        if scrape is not None:
            c, g = scrape.counters, scrape.gauges
            old = self.scrapes[0] if self.scrapes and self.scrapes[0] is not scrape else None
            vllm.update({
                "throughput": {
                    "decode_tps": {"current": rounded(iv.decode_tps if iv else None),
                                   "active_avg": rounded(active_avg("decode_tps"))},
                    "prefill_tps": {"current": rounded(iv.prefill_tps if iv else None),
                                    "active_avg": rounded(active_avg("prefill_tps"))},
                },
                "tokens": {"prompt_total": c.get(F.PROMPT_TOKENS), "generation_total": c.get(F.GENERATION_TOKENS),
                           "requests_finished": c.get(F.REQUEST_SUCCESS), "preemptions": c.get(F.PREEMPTIONS)},
                "requests": {"running": g.get(F.RUNNING), "waiting": g.get(F.WAITING)},
                "kv_cache_usage": rounded(g.get(F.KV_USAGE), 4),
                "latency": {"window_s": rounded(scrape.at - old.at, 1) if old else 0.0,
                            **{key: {k: [rounded(x, 6) for x in v] if isinstance(v, list) else rounded(v, 6)
                                     for k, v in rates.latency(old, scrape, name).items()}
                               for key, name in LATENCIES}},
                "spec_decode": self._spec(scrape, iv),
                # Nothing running or waiting: what moves now is the head's 1-token liveness
                # probe (dspark.node.liveness sends one only while the engine is idle).
                "idle": not (g.get(F.RUNNING) or g.get(F.WAITING)),
            })
        else:
            vllm.update({"throughput": None, "tokens": None, "requests": None, "kv_cache_usage": None,
                         "latency": None, "spec_decode": None, "idle": None})
        vllm["finished"] = self._finished(scrape, iv) if scrape is not None else None
        if self.rounds:
            self.history.record(iv, scrape.gauges if scrape is not None else {}, vllm["finished"] or {},
                                vllm["latency"] or {})
        snap = {
            "schema_version": SCHEMA_VERSION,
            "generated_at": round(time.time(), 3),
            "interval_s": self.interval_s,
            "round": self.rounds,
            "serving": scrape is not None and bool(nodes) and all(n["state"] == A.SERVING for n in nodes),
            "model": self.targets.served_name,
            "liveness_interval_s": self.targets.liveness_interval_s,
            "runtime_line": lines,
            "vllm": vllm,
            "nodes": nodes,
            "history": self.history.to_json(),
            "events": self.timeline.shown(),
        }
        data = json.dumps(snap, separators=(",", ":")).encode()
        with self._lock:
            self._snapshot, self._json = snap, data
        return snap

    def _finished(self, scrape: Scrape, iv: rates.Interval | None) -> dict:
        """Finished requests: the rate over the last interval and over the window, and by why they
        finished (errors and aborts), from vllm:request_success and its finished_reason label. The
        scrapes and their reasons are in self.scrapes and self.reasons, `scrape` the last of them
        (both restart at a counter reset: the window is the new process's)."""
        total = scrape.counters.get(F.REQUEST_SUCCESS)
        reasons = self.reasons[-1]
        reset = iv is not None and iv.reset
        prev = self.scrapes[-2] if len(self.scrapes) >= 2 else None
        before = self.reasons[-2] if len(self.reasons) >= 2 else None
        old, first = self.scrapes[0], self.reasons[0]
        per_s = window_per_s = None
        if iv is not None and total is not None and iv.dt_s > 0:
            d = rates.counter_delta(prev.counters.get(F.REQUEST_SUCCESS) if prev else None, total, reset)
            per_s = None if d is None else d / iv.dt_s
        if old is not scrape and total is not None and scrape.at > old.at:
            d = rates.counter_delta(old.counters.get(F.REQUEST_SUCCESS), total, False)
            window_per_s = None if d is None else d / (scrape.at - old.at)

        def in_window(reason: str) -> float | None:
            if reasons is None:
                return None
            return max(0.0, reasons.get(reason, 0.0) - (first or {}).get(reason, 0.0)) if old is not scrape else 0.0

        def in_interval(reason: str) -> float | None:
            return rates.reason_delta(before, reasons, reason, reset) if iv is not None else None

        return {
            "per_s": rounded(per_s),
            "window_per_s": rounded(window_per_s),
            "window_s": rounded(scrape.at - old.at, 1),
            "total": total,
            "errors_total": reasons.get(F.FINISHED_ERROR, 0.0) if reasons is not None else None,
            "aborts_total": reasons.get(F.FINISHED_ABORT, 0.0) if reasons is not None else None,
            "errors_window": in_window(F.FINISHED_ERROR),
            "aborts_window": in_window(F.FINISHED_ABORT),
            "errors_interval": in_interval(F.FINISHED_ERROR),
            "aborts_interval": in_interval(F.FINISHED_ABORT),
        }

    @staticmethod
    def _spec(scrape: Scrape, iv: rates.Interval | None) -> dict | None:
        life = rates.spec_decode(scrape)
        if life is None:
            return None
        return {"acceptance_rate": {"current": rounded(iv.spec_acceptance if iv else None, 4),
                                    "lifetime": rounded(life["acceptance_rate"], 4)},
                "mean_acceptance_length": rounded(life["mean_acceptance_length"], 3),
                "draft_tokens": life["draft_tokens"], "accepted_tokens": life["accepted_tokens"]}

