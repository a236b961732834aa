"""The node agent: a small read-only HTTP endpoint each `dspark serve` runs on its own port.

GET /state    JSON: the node's state, rank, vLLM pid and version, restarts, uptime, last liveness
GET /metrics  the same as Prometheus text
GET /healthz  200 while the supervisor runs
Anything else is 404; any method but GET/HEAD is 405. The agent never changes anything.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler
from typing import Callable

from . import __version__
from .http_server import BoundedHTTPServer, discard_body

# The node states and the snapshot the agent serves live in dspark.states (re-exported here).
from .states import (  # noqa: E402,F401
    FAILED, LOADING, RENDEZVOUS, SERVING, STARTING, STATES, STOPPED, STOPPING, WARMING, Liveness, NodeState,
)


def metrics_text(s: dict) -> str:
    """Prometheus exposition of a state snapshot (names prefixed dspark_node_)."""
    from prometheus_client import CollectorRegistry, Gauge, generate_latest

    reg = CollectorRegistry()
    labels = {"node": s["node"], "rank": str(s["rank"]), "role": s["role"]}
    info = Gauge("dspark_node_info", "Node identity and versions", [*labels, "vllm_version", "dspark_version"],
                 registry=reg)
    info.labels(**labels, vllm_version=s["vllm_version"] or "", dspark_version=s["dspark_version"]).set(1)
    state = Gauge("dspark_node_state", "1 for the node's current state", [*labels, "state"], registry=reg)
    for name in STATES:
        state.labels(**labels, state=name).set(1 if s["state"] == name else 0)
    simple = [
        ("dspark_node_restarts", "Times this node's service was restarted", s["restarts"]),
        ("dspark_node_uptime_seconds", "Seconds since this supervisor started", s["uptime_s"]),
        ("dspark_node_vllm_pid", "PID of the vLLM process (0 when none)", s["vllm_pid"] or 0),
    ]
    live = s.get("liveness")
    if live:
        simple += [
            ("dspark_node_liveness_ok", "1 if the last liveness round found the engine alive", 1 if live["ok"] else 0),
            ("dspark_node_liveness_timestamp_seconds", "Unix time of the last liveness round", live["at"]),
        ]
        if live.get("proof_at") is not None:
            simple.append(("dspark_node_liveness_proof_timestamp_seconds",
                           "Unix time of the last proof of life (progress or probe)", live["proof_at"]))
            proof = Gauge("dspark_node_liveness_proof", "1 for the kind of the last proof of life",
                          [*labels, "proof"], registry=reg)
            for kind in ("progress", "probe"):
                proof.labels(**labels, proof=kind).set(1 if live.get("proof") == kind else 0)
        if live.get("latency_s") is not None:
            simple.append(("dspark_node_liveness_latency_seconds", "Latency of the last liveness completion",
                           live["latency_s"]))
    for name, doc, value in simple:
        Gauge(name, doc, list(labels), registry=reg).labels(**labels).set(value)
    return generate_latest(reg).decode()


class Agent:
    """Serves `snapshot()` read-only on (host, port) from a daemon thread."""

    def __init__(self, host: str, port: int, snapshot: Callable[[], dict]):
        self.snapshot = snapshot
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
                    data, ctype = metrics_text(agent.snapshot()).encode(), "text/plain; version=0.0.4"
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

            def log_message(self, *args) -> None:  # keep the journal for the supervisor's own lines
                pass

        self.server = BoundedHTTPServer((host, port), Handler)  # socket timeout, connection cap
        self.thread = threading.Thread(target=self.server.serve_forever, name="dspark-agent", daemon=True)

    @property
    def port(self) -> int:
        return self.server.server_address[1]

    def start(self) -> "Agent":
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
