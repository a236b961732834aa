"""The node agent: a small read-only HTTP endpoint each `dspark serve` runs on its own port.

GET /state    JSON: the node's state, rank, vLLM pid and version, restarts, uptime, last liveness
GET /metrics  the same as Prometheus text: a prometheus_client Collector (SnapshotCollector),
              registered once in the agent's own registry, reads the snapshot at each scrape
GET /healthz  200 while the supervisor runs
Anything else is 404; any method but GET/HEAD is 405. The agent never changes anything.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterable, Iterator
from http.server import BaseHTTPRequestHandler
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from dspark import __version__
from dspark.net.server import BoundedHTTPServer, discard_body

# The node states and the snapshot the agent serves live in dspark.node.states (re-exported here).
from dspark.node.states import (
    STATES,
)

# What generate_latest writes: the text format 0.0.4 (prometheus_client's CONTENT_TYPE_LATEST names a
# newer one in its recent releases).
METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# The node's own figures, one gauge each: (name, help, the snapshot's value). Labels node, rank, role.
_SIMPLE = (
    ("dspark_node_restarts", "Times this node's service was restarted", lambda s: s["restarts"]),
    ("dspark_node_uptime_seconds", "Seconds since this supervisor started", lambda s: s["uptime_s"]),
    ("dspark_node_vllm_pid", "PID of the vLLM process (0 when none)", lambda s: s["vllm_pid"] or 0),
)
# The node's memory (the snapshot's `memory`, where its supervisor reports one): on GB10 the unified
# memory NVML and /proc/meminfo report, elsewhere the host's. Labels node, rank, role and source.
MEMORY_GAUGES = (
    ("dspark_node_memory_total_bytes", "total_bytes", "Memory of the node (bytes)"),
    ("dspark_node_memory_used_bytes", "used_bytes", "Memory in use on the node (bytes)"),
    ("dspark_node_memory_available_bytes", "available_bytes",
     "Memory available to new allocations on the node (bytes)"),
)


def _number(value: object) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


class SnapshotCollector(Collector):
    """prometheus_client's way to proxy another system's state: registered once for the agent's
    life, it reads the supervisor's snapshot at each scrape and yields its gauges (names prefixed
    dspark_node_, labels node, rank and role). Nothing is kept between scrapes."""

    def __init__(self, snapshot: Callable[[], dict]):
        self.snapshot = snapshot

    def describe(self) -> Iterable[Metric]:
        return ()  # the metrics exist only at a scrape: registering must not read the snapshot

    def collect(self) -> Iterator[Metric]:
        yield from snapshot_metrics(self.snapshot())


def snapshot_metrics(s: dict) -> Iterator[Metric]:
    """The metric families of one state snapshot."""
    keys = ["node", "rank", "role"]
    ident = [s["node"], str(s["rank"]), s["role"]]

    def gauge(name: str, doc: str, extra: tuple[str, ...] = ()) -> GaugeMetricFamily:
        return GaugeMetricFamily(name, doc, labels=[*keys, *extra])

    info = gauge("dspark_node_info", "Node identity and versions", ("vllm_version", "dspark_version"))
    info.add_metric([*ident, s["vllm_version"] or "", s["dspark_version"]], 1)
    yield info
    state = gauge("dspark_node_state", "1 for the node's current state", ("state",))
    for name in STATES:
        state.add_metric([*ident, name], 1 if s["state"] == name else 0)
    yield state
    simple = [(name, doc, value(s)) for name, doc, value in _SIMPLE]
    live = s.get("liveness")
    if live:
        simple += [
            ("dspark_node_liveness_ok", "1 if the last liveness round found the engine alive", 1 if live["ok"] else 0),
            ("dspark_node_liveness_timestamp_seconds", "Unix time of the last liveness round", live["at"]),
        ]
        if live.get("proof_at") is not None:
            simple.append(("dspark_node_liveness_proof_timestamp_seconds",
                           "Unix time of the last proof of life (progress or probe)", live["proof_at"]))
            proof = gauge("dspark_node_liveness_proof", "1 for the kind of the last proof of life", ("proof",))
            for kind in ("progress", "probe"):
                proof.add_metric([*ident, kind], 1 if live.get("proof") == kind else 0)
            yield proof
        if live.get("latency_s") is not None:
            simple.append(("dspark_node_liveness_latency_seconds", "Latency of the last liveness completion",
                           live["latency_s"]))
    for name, doc, value in simple:
        g = gauge(name, doc)
        g.add_metric(ident, value)
        yield g
    memory = s.get("memory")
    if isinstance(memory, dict):
        source = str(memory.get("source") or "")
        for name, key, doc in MEMORY_GAUGES:
            value = _number(memory.get(key))
            if value is not None:  # a figure the node could not read is left out, not reported as 0
                g = gauge(name, doc, ("source",))
                g.add_metric([*ident, source], value)
                yield g


def metrics_text(s: dict) -> str:
    """Prometheus exposition of one state snapshot (what GET /metrics serves for it)."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(SnapshotCollector(lambda: s))
    return generate_latest(reg).decode()


class Agent:
    """Serves `snapshot()` read-only on (host, port) from a daemon thread."""

    def __init__(self, host: str, port: int, snapshot: Callable[[], dict]):
        self.snapshot = snapshot
        # One registry for the agent's life (not prometheus_client's global one: several agents
        # may run in one process, in the tests); the collector reads the snapshot at each scrape.
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(SnapshotCollector(lambda: self.snapshot()))
        agent = self

        class Handler(BaseHTTPRequestHandler):
            server_version = f"dspark-agent/{__version__}"

            def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
                self._answer(body=True)

            def do_HEAD(self) -> None:  # noqa: N802
                self._answer(body=False)

            def _answer(self, body: bool) -> None:
                path = self.path.split("?", 1)[0]
                if path == "/state":
                    data, ctype = json.dumps(agent.snapshot()).encode(), "application/json"
                elif path == "/metrics":
                    data, ctype = generate_latest(agent.registry), METRICS_CONTENT_TYPE
                elif path == "/healthz":
                    data, ctype = b"ok\n", "text/plain"
                else:
                    self.send_error(404, "not found (try /state or /metrics)")
                    return
                self.send_response(200)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                self.send_header("Cache-Control", "no-store")
                self.end_headers()
                if body:
                    self.wfile.write(data)

            def _refuse(self) -> None:
                discard_body(self)
                self.send_error(405, "read-only agent")

            do_POST = do_PUT = do_DELETE = do_PATCH = _refuse

            def log_message(self, *args: Any) -> None:  # keep the journal for the supervisor's own lines
                pass

        self.server = BoundedHTTPServer((host, port), Handler)  # socket timeout, connection cap
        self.thread = threading.Thread(target=self.server.serve_forever, name="dspark-agent", daemon=True)

    @property
    def port(self) -> int:
        return self.server.server_address[1]

    def start(self) -> Agent:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
