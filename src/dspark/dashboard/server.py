"""The dashboard's HTTP server: read-only, loopback by default, optional access token.

GET /                    the page (static/index.html; it loads app.js and style.css)
GET /static/NAME         the page's assets, and snapshot.schema.json (the JSON endpoint's schema,
                         generated from dashboard/snapshot_model.py)
GET /api/v1/snapshot     the collector's latest snapshot (JSON; needs the token when one is set)
GET /healthz             "ok" (for the unit)
Every other method answers 405. The browser talks to this server only, never to vLLM.

The page and its assets hold no data and are served without the token; the page asks for
the token (or takes it from the URL fragment, which browsers never send to a server) and
sends it as `Authorization: Bearer` to /api/. The token comes from a file that others cannot
read, never from the command line, and is compared in constant time.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import re
import signal
import stat
import threading
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler
from importlib import resources
from pathlib import Path
from typing import Any

from dspark import __version__
from dspark.dashboard.collector import Collector
from dspark.dashboard.snapshot_model import schema_json
from dspark.files.safe_read import MAX_SECRET_BYTES, read_text
from dspark.net.server import BoundedHTTPServer, discard_body
from dspark.node.signals import SignalQueue

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8899
# systemd's LoadCredential= name the unit can use instead of --token-file
TOKEN_CREDENTIAL = "dashboard-token"
SNAPSHOT_PATH = "/api/v1/snapshot"
CONTENT_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
                 ".css": "text/css; charset=utf-8", ".json": "application/json", ".svg": "image/svg+xml"}
SECURITY_HEADERS = {
    # no inline script, no third-party origin: the page only ever talks to this server
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; style-src 'self'; "
                               "script-src 'self'; connect-src 'self'; frame-ancestors 'none'; base-uri 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
}
_ASSET_NAME = re.compile(r"^[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*\.[a-z]+$")


class DashboardError(Exception):
    """A setting that prevents starting (the CLI shows the message, no traceback)."""


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def load_token(path: Path) -> str:
    """The access token from `path`, which only its owner may read or write (mode 600 or 400)."""
    try:
        st = path.stat()
        text = read_text(path, MAX_SECRET_BYTES)
    except OSError as e:
        raise DashboardError(f"cannot read the token file {path}: {e.strerror}") from None
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise DashboardError(f"the token file {path} is accessible to its group or others (mode "
                             f"{stat.S_IMODE(st.st_mode):04o}); run: chmod 600 {path}")
    token = text.strip()
    if not token:
        raise DashboardError(f"the token file {path} is empty")
    return token


def default_token_file(env: Mapping[str, str] | None = None) -> Path | None:
    """systemd's credential (LoadCredential=dashboard-token:...) when the unit provides one."""
    env = os.environ if env is None else env
    cred = env.get("CREDENTIALS_DIRECTORY")
    if cred and (Path(cred) / TOKEN_CREDENTIAL).is_file():
        return Path(cred) / TOKEN_CREDENTIAL
    return None


def check_bind(host: str, token: str | None) -> None:
    if token is None and not is_loopback(host):
        raise DashboardError(f"binding {host} (not loopback) needs an access token: pass --token-file FILE "
                             f"(mode 600), or bind 127.0.0.1 and reach it through an SSH tunnel")


def _token_ok(expected: str, header: str | None) -> bool:
    if not header or not header.startswith("Bearer "):
        return False
    # equal-length digests: the comparison time says nothing about the token, not even its length
    a = hashlib.sha256(expected.encode()).digest()
    b = hashlib.sha256(header[len("Bearer "):].strip().encode()).digest()
    return hmac.compare_digest(a, b)


def _read_assets() -> dict[str, bytes]:
    """The page's files, read once (package data under dspark/dashboard/static/), and the
    snapshot's schema, generated from its declaration."""
    root = resources.files("dspark.dashboard") / "static"
    assets = {p.name: p.read_bytes() for p in root.iterdir() if p.is_file() and _ASSET_NAME.match(p.name)}
    return {**assets, "snapshot.schema.json": schema_json()}


class DashboardServer:
    def __init__(self, host: str, port: int, collector: Collector, token: str | None = None):
        check_bind(host, token)
        self.collector = collector
        self.token = token
        self.host = host
        self.assets = _read_assets()
        # Behind loopback without a token, also refuse foreign Host headers, so that a web page
        # elsewhere cannot read the dashboard through DNS rebinding.
        self.allowed_hosts = {"localhost", "127.0.0.1", "::1", host} if token is None else None
        srv = self

        class Handler(BaseHTTPRequestHandler):
            server_version = f"dspark-dashboard/{__version__}"
            protocol_version = "HTTP/1.1"  # one request per connection all the same (http_server: no keep-alive)

            def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
                discard_body(self)
                srv._answer(self, body=True)

            def do_HEAD(self) -> None:  # noqa: N802
                discard_body(self)
                srv._answer(self, body=False)

            def _refuse(self) -> None:
                discard_body(self)  # else its bytes would be read as the next request
                self.send_response(405)
                self.send_header("Allow", "GET, HEAD")
                self.send_header("Content-Length", "0")
                if self.close_connection:
                    self.send_header("Connection", "close")
                self.end_headers()

            do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _refuse

            def log_message(self, *args: Any) -> None:  # one line per request each second would drown the journal
                pass

        self.server = BoundedHTTPServer((host.strip("[]"), port), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, name="dashboard-http", daemon=True)

    @property
    def port(self) -> int:
        return self.server.server_address[1]

    @property
    def url(self) -> str:
        h = self.host if ":" not in self.host else f"[{self.host.strip('[]')}]"
        return f"http://{h}:{self.port}"

    def start(self) -> DashboardServer:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _answer(self, h: BaseHTTPRequestHandler, body: bool) -> None:
        path = h.path.split("?", 1)[0].split("#", 1)[0]
        if self.allowed_hosts is not None:
            host = (h.headers.get("Host") or "").strip()
            name = host.rsplit(":", 1)[0] if not host.startswith("[") else host[1:].split("]", 1)[0]
            if name not in self.allowed_hosts:
                return self._send(h, 421, b"unknown Host\n", "text/plain", body)
        if path == SNAPSHOT_PATH:
            if self.token is not None and not _token_ok(self.token, h.headers.get("Authorization")):
                return self._send(h, 401, b'{"error":"access token required"}', "application/json", body,
                                  {"WWW-Authenticate": 'Bearer realm="dspark-dashboard"'})
            return self._send(h, 200, self.collector.snapshot_json(), "application/json", body)
        if path in ("/", "/index.html"):
            name = "index.html"
        elif path.startswith("/static/"):
            name = path[len("/static/"):]
        elif path == "/healthz":
            return self._send(h, 200, b"ok\n", "text/plain", body)
        else:
            return self._send(h, 404, b"not found\n", "text/plain", body)
        data = self.assets.get(name)
        if data is None:
            return self._send(h, 404, b"not found\n", "text/plain", body)
        self._send(h, 200, data, CONTENT_TYPES.get(Path(name).suffix, "application/octet-stream"), body)

    @staticmethod
    def _send(h: BaseHTTPRequestHandler, code: int, data: bytes, ctype: str, body: bool,
              extra: dict[str, str] | None = None) -> None:
        h.send_response(code)
        h.send_header("Content-Type", ctype)
        h.send_header("Content-Length", str(len(data)))
        h.send_header("Cache-Control", "no-store")
        for k, v in {**SECURITY_HEADERS, **(extra or {})}.items():
            h.send_header(k, v)
        h.end_headers()
        if body:
            h.wfile.write(data)


def serve(collector: Collector, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT, token: str | None = None,
          on_ready: Callable[[DashboardServer], object] | None = None) -> int:
    """Run the collector and the server until SIGTERM or SIGINT. Returns the exit code."""
    from dspark.node.notify import Notifier

    server = DashboardServer(host, port, collector, token)  # raises before anything starts
    sigs = SignalQueue().install((signal.SIGTERM, signal.SIGINT))  # only records; the loop below acts
    notify = Notifier()
    collector.start()
    server.start()
    try:
        notify.ready(f"dashboard on {server.url}")
        if on_ready:
            on_ready(server)
        while sigs.first is None:
            sigs.get(1.0)
        notify.stopping("stopping")
        return 0
    finally:
        server.stop()
        collector.stop()
        notify.close()
        sigs.restore()
