"""Test helpers: a stand-in for vLLM's /metrics endpoint only (for answers the real vLLM never
gives: malformed text, then none at all), captured scrapes, and the snapshot's JSON Schema."""

from __future__ import annotations

import json
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from dspark.dashboard import snapshot_model as model

FIXTURES = Path(__file__).parents[1] / "dashboard" / "fixtures"


def scrape_text(name: str) -> str:
    return (FIXTURES / f"vllm_metrics_{name}.txt").read_text()


def snapshot_schema() -> dict:
    return model.snapshot_schema()


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
        # A close waits for the loop's next look at shutdown(): 0.05 s, not socketserver's 0.5 s.
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05},
                                       daemon=True)
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


class DashboardProcess:
    """`dspark dashboard` as the unit runs it (a subprocess); stopped by its PID."""

    def __init__(self, cluster_file: Path, log: Path):
        import subprocess
        import sys

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = open(log, "wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "dspark", "dashboard", "--config", str(cluster_file),
                                      "--port", str(self.port)], stdout=self._log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 60) -> dict:
        import time
        import urllib.error

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"dspark dashboard exited with {self.proc.returncode}")
            try:
                with urllib.request.urlopen(self.url + "/api/v1/snapshot", timeout=2) as r:
                    snap = json.loads(r.read())
                if snap["round"] >= 2:
                    return snap
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.3)
        raise RuntimeError("dspark dashboard did not answer")

    def stop(self) -> None:
        import subprocess

        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._log.close()


class Load:
    """A bounded decode load on loopback: `concurrency` clients send completions (token-id
    prompts, exact lengths) until stop(), `max_requests` or `max_s`, whichever comes first."""

    def __init__(self, api_url: str, model: str = "dspark-local", concurrency: int = 2, max_tokens: int = 32,
                 prompt_len: int = 24, max_requests: int = 400, max_s: float = 120.0):
        self.api_url, self.model = api_url, model
        self.concurrency, self.max_tokens, self.prompt_len = concurrency, max_tokens, prompt_len
        self.max_requests, self.max_s = max_requests, max_s
        self.stop_event = threading.Event()
        self.sent = self.ok = self.failed = 0
        self._lock = threading.Lock()
        self.threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(concurrency)]

    def _client(self, i: int) -> None:
        import time

        deadline = time.monotonic() + self.max_s
        while not self.stop_event.is_set() and time.monotonic() < deadline:
            with self._lock:
                if self.sent >= self.max_requests:
                    return
                self.sent += 1
                n = self.sent
            body = json.dumps({"model": self.model, "prompt": [(n * 7 + k) % 4000 + 2 for k in range(self.prompt_len)],
                               "max_tokens": self.max_tokens, "ignore_eos": True, "temperature": 0}).encode()
            req = urllib.request.Request(self.api_url + "/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=60) as r:
                    r.read()
                with self._lock:
                    self.ok += 1
            except OSError:
                with self._lock:
                    self.failed += 1
                self.stop_event.wait(0.5)

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop_event.set()
        for t in self.threads:
            t.join(timeout=90)
