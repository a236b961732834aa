"""The collector: ONE thread polls vLLM's /metrics and every node agent once per interval,
keeps a bounded history, and renders the JSON snapshot once per round. Every browser client
is served those same bytes, so N open pages cost N small copies, not N scrapes.

Nothing the targets answer can stop the thread: an unreachable or malformed /metrics makes
the vLLM part "unavailable" (available: false, error: why) until a good answer comes back.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from dspark.config.schema import Cluster
from dspark.dashboard import rates
from dspark.dashboard.snapshot_model import UNREACHABLE
from dspark.engine import facts as F
from dspark.engine.metrics import MetricsError, Scrape, parse
from dspark.net.http import HTTPFailure, request
from dspark.node import hardware, host_memory
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
# The timeline: the nodes' events (dspark.node.states.NodeState.events) merged, and the dashboard's own
# "lost" (an agent gone without a word: a kill -9, a host down). EVENTS_KEPT in memory, the newest
# EVENTS_SHOWN of them in each snapshot.
EVENTS_KEPT = 512
EVENTS_SHOWN = 100
EVENT_TEXT_MAX = 240
LATENCIES = (("ttft_s", F.TTFT), ("itl_s", F.ITL), ("e2e_s", F.E2E))
QUANTILE_KEYS = ("p50_low", "p50_high", "p95_low", "p95_high")
HISTORY_KEYS = ("t", "decode_tps", "prefill_tps", "running", "waiting", "kv_cache_usage",
                "requests_per_s", "errors", "aborts", "latency")


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
    events_at: float = -math.inf  # the newest event taken from this node's ring
    events_keys: frozenset = frozenset()  # the events taken at exactly that time
    lost: bool = False  # a "lost" event is in the timeline since the agent last answered


def _r(x: float | None, nd: int = 3) -> float | None:
    return None if x is None else round(x, nd)


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
        self.history: deque[tuple] = deque(maxlen=history_len)
        self.scrapes: deque[Scrape] = deque(maxlen=max(2, int(window_s / interval_s) + 1))
        # vllm:request_success by finished_reason, one per scrape in self.scrapes (None: not said)
        self.reasons: deque[dict[str, float] | None] = deque(maxlen=self.scrapes.maxlen)
        self.events: deque[dict] = deque(maxlen=EVENTS_KEPT)
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
            self._take_events(t.name, mem, s.get("events"))
        elif state == A.FAILED and mem.last_ok is not None and not mem.lost:
            # The agent is gone without a clean stop: its own ring says nothing more (a kill -9, a
            # crash, a host down), so the timeline says it from here.
            mem.lost = True
            self._add_event({"at": round(time.time(), 3), "node": t.name, "kind": "lost", "detail": detail,
                             "by": "dashboard"})
        if isinstance(last.get("hardware"), dict):
            hw, source = last["hardware"], "agent"
        elif t.name == self.targets.local_node:
            hw, source = hardware.read_local(self.gpu, self.hwmon), "local"
        else:
            hw, source = {"gpus": [], "nvme_temperature_c": None}, None
        return {
            "name": t.name, "rank": t.rank, "role": t.role, "agent_url": t.agent_url,
            "runtime_line": _line(last.get("runtime_line")), "file_line": _line(last.get("file_line")),
            "other_line": False,  # set by _lines, which compares with the head
            "reachable": s is not None, "state": state, "detail": detail,
            "silent_s": _r(silent, 1) if s is None else 0.0,
            "restarts": last.get("restarts"), "vllm_pid": last.get("vllm_pid"),
            "vllm_version": last.get("vllm_version"), "uptime_s": last.get("uptime_s"),
            "liveness": _liveness(last.get("liveness")),
            "hardware": {"source": source, "gpus": hw.get("gpus") or [],
                         "nvme_temperature_c": hw.get("nvme_temperature_c")},
            "memory": _memory(last.get("memory")),
        }, holds

    def _take_events(self, node: str, mem: _NodeMemory, events: object) -> None:
        """The events of a node's ring that the timeline does not hold yet: those after the newest
        taken (the ring is in time order; a restarted node's new ring starts later)."""
        if not isinstance(events, list):
            return
        newest, keys = mem.events_at, set(mem.events_keys)
        for e in events[-A.EVENTS_MAX:]:
            ev = _event(e, node)
            if ev is None:
                continue
            key = (ev["at"], ev["kind"], ev["detail"])
            if ev["at"] < mem.events_at or (ev["at"] == mem.events_at and key in mem.events_keys):
                continue
            self._add_event(ev)
            if ev["at"] > newest:
                newest, keys = ev["at"], set()
            keys.add(key)
        mem.events_at, mem.events_keys = newest, frozenset(keys)

    def _add_event(self, ev: dict) -> None:
        self.events.append(ev)
        if len(self.events) > 1 and self.events[-2]["at"] > ev["at"]:  # nodes' events interleave
            ordered = sorted(self.events, key=lambda e: e["at"])
            self.events.clear()
            self.events.extend(ordered)

    def _lines(self, nodes: list[dict], answers: list[dict | None]) -> dict:
        """Which runtime line the pair runs (the head's), which nodes run another one (marked in
        their card), and the switch under way that the head's agent reports (dspark switch)."""
        head = next((i for i, t in enumerate(self.targets.nodes) if t.role == "head"), None)
        head_answer = answers[head] if head is not None else None
        head_line = _line(head_answer.get("runtime_line")) if head_answer is not None else None
        for n, a in zip(nodes, answers, strict=True):
            theirs = _line(a.get("runtime_line")) if a is not None else None
            n["other_line"] = n["role"] != "head" and None not in (head_line, theirs) and theirs != head_line
        return {"head": head_line, "mixed": any(n["other_line"] for n in nodes),
                "switch": _switch(head_answer.get("line_switch")) if head_answer is not None else None}

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
                    "decode_tps": {"current": _r(iv.decode_tps if iv else None),
                                   "active_avg": _r(active_avg("decode_tps"))},
                    "prefill_tps": {"current": _r(iv.prefill_tps if iv else None),
                                    "active_avg": _r(active_avg("prefill_tps"))},
                },
                "tokens": {"prompt_total": c.get(F.PROMPT_TOKENS), "generation_total": c.get(F.GENERATION_TOKENS),
                           "requests_finished": c.get(F.REQUEST_SUCCESS), "preemptions": c.get(F.PREEMPTIONS)},
                "requests": {"running": g.get(F.RUNNING), "waiting": g.get(F.WAITING)},
                "kv_cache_usage": _r(g.get(F.KV_USAGE), 4),
                "latency": {"window_s": _r(scrape.at - old.at, 1) if old else 0.0,
                            **{key: {k: [_r(x, 6) for x in v] if isinstance(v, list) else _r(v, 6)
                                     for k, v in rates.latency(old, scrape, name).items()}
                               for key, name in (("ttft_s", F.TTFT), ("itl_s", F.ITL), ("e2e_s", F.E2E))}},
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
            g = scrape.gauges if scrape is not None else {}
            fin = vllm["finished"] or {}
            lat = vllm["latency"] or {}
            self.history.append((round(time.time(), 3), _r(iv.decode_tps if iv else None),
                                 _r(iv.prefill_tps if iv else None), g.get(F.RUNNING), g.get(F.WAITING),
                                 _r(g.get(F.KV_USAGE), 4), fin.get("per_s"), fin.get("errors_interval"),
                                 fin.get("aborts_interval"),
                                 {key: _quantiles(lat.get(key)) for key, _ in LATENCIES}))
        cols = list(zip(*self.history, strict=True)) if self.history else [()] * len(HISTORY_KEYS)
        history: dict = {"capacity": self.history.maxlen,
                         **{k: list(v) for k, v in zip(HISTORY_KEYS, cols, strict=True)}}
        history["latency"] = {key: {q: [p[key][i] for p in history["latency"]] for i, q in enumerate(QUANTILE_KEYS)}
                              for key, _ in LATENCIES}
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
            "history": history,
            "events": list(self.events)[-EVENTS_SHOWN:],
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
            "per_s": _r(per_s),
            "window_per_s": _r(window_per_s),
            "window_s": _r(scrape.at - old.at, 1),
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
        return {"acceptance_rate": {"current": _r(iv.spec_acceptance if iv else None, 4),
                                    "lifetime": _r(life["acceptance_rate"], 4)},
                "mean_acceptance_length": _r(life["mean_acceptance_length"], 3),
                "draft_tokens": life["draft_tokens"], "accepted_tokens": life["accepted_tokens"]}


def _number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _memory(m: object) -> dict | None:
    """A node's memory as its agent reports it (dspark.node.host_memory); None for anything else."""
    if not isinstance(m, dict) or m.get("source") not in host_memory.SOURCES:
        return None
    figures: dict[str, int] = {}
    for k in ("total_bytes", "used_bytes", "available_bytes"):
        v = m.get(k)
        if not _number(v) or cast(float, v) < 0:
            return None
        figures[k] = int(cast(float, v))
    if not figures["total_bytes"]:
        return None
    return {**figures, "source": m["source"]}


def _event(e: object, node: str) -> dict | None:
    """One event of a node's ring (dspark.node.states.NodeState.events); None for anything else."""
    if not isinstance(e, dict) or not _number(e.get("at")) or e["at"] <= 0:
        return None
    kind, detail = e.get("kind"), e.get("detail", "")
    if not isinstance(kind, str) or not 0 < len(kind) <= 32 or not isinstance(detail, str):
        return None
    return {"at": round(float(e["at"]), 3), "node": node, "kind": kind, "detail": detail[:EVENT_TEXT_MAX],
            "by": "node"}


def _quantiles(lat: dict | None) -> tuple:
    """(p50 low, p50 high, p95 low, p95 high) of one latency over the window, for the history;
    None where nothing finished in it (a high of None: unbounded)."""
    if not lat:
        return (None,) * 4
    p50, p95 = lat.get("p50_range") or (None, None), lat.get("p95_range") or (None, None)
    return (p50[0], p50[1], p95[0], p95[1])


def _liveness(live: object) -> dict | None:
    """The head's last liveness round and the last proof of life, as the agent reports them."""
    if not isinstance(live, dict):
        return None
    at = live.get("proof_at")
    age = time.time() - at if isinstance(at, (int, float)) and not isinstance(at, bool) else None
    proof = live.get("proof") if live.get("proof") in ("progress", "probe") else None
    detail = live.get("proof_detail")
    return {"ok": live.get("ok") is True, "proof": proof,
            "proof_age_s": _r(max(age, 0.0), 1) if age is not None else None,
            "proof_detail": detail if isinstance(detail, str) else ""}


def _line(x: object) -> str | None:
    """A runtime line's name as an agent reports it (None from an agent before runtime lines, or
    for anything that is not a name: the page shows it in one table cell)."""
    return x if isinstance(x, str) and 0 < len(x) <= 64 else None


def _switch(sw: object) -> dict | None:
    """The head's switch under way (dspark.lines.state.Switch.to_json()), with how long it has run;
    None when there is none or the record is not one the page can show."""
    if not isinstance(sw, dict) or _line(sw.get("from")) is None or _line(sw.get("to")) is None:
        return None
    at = sw.get("at")
    known = isinstance(at, (int, float)) and not isinstance(at, bool) and math.isfinite(at)
    age = time.time() - cast(float, at) if known else None
    sid = sw.get("id")
    return {"id": sid if isinstance(sid, str) else "", "from": sw["from"], "to": sw["to"],
            "rollback": sw.get("rollback") is True, "at": at if age is not None else None,
            "for_s": _r(max(age, 0.0), 1) if age is not None else None}
