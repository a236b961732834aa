"""Test helpers: a stand-in for vLLM's /metrics endpoint only (for answers the real vLLM never
gives: malformed text, then none at all), captured scrapes, and the snapshot's JSON Schema."""

from __future__ import annotations

import json
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from pathlib import Path

FIXTURES = Path(__file__).parent / "fixtures"


def scrape_text(name: str) -> str:
    return (FIXTURES / f"vllm_metrics_{name}.txt").read_text()


def snapshot_schema() -> dict:
    return json.loads((resources.files("dspark.dashboard") / "static" / "snapshot.schema.json").read_text())


def validate_snapshot(snap: dict) -> None:
    import jsonschema

    jsonschema.validate(snap, snapshot_schema(), cls=jsonschema.Draft202012Validator)


class MetricsStandIn:
    """Serves GET /metrics with `text` (or relays `relay_url`'s answer); counts the scrapes."""

    def __init__(self, text: str = "", status: int = 200):
        self.text, self.status, self.relay_url = text, status, None
        self.hits = 0
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                if self.path != "/metrics":
                    self.send_error(404)
                    return
                stand_in.hits += 1
                status, body = stand_in.status, stand_in.text.encode()
                if stand_in.relay_url:
                    with urllib.request.urlopen(stand_in.relay_url + "/metrics", timeout=5) as r:
                        status, body = r.status, r.read()
                self.send_response(status)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
