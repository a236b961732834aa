"""A real loopback HTTP server whose answers a test scripts: hostile and misbehaving peers
(redirects, endless or trickling bodies, JSON that is not an object). Every server stops at
the end of its `with` block; every handler's loop is bounded in time."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

Handler = Callable[[BaseHTTPRequestHandler], None]
MAX_HANDLER_S = 20.0  # no scripted answer runs longer than this


class HostileServer:
    """`routes` maps a path to a function that answers on the handler; `seen` records every
    request's (method, path, headers). `port` 0 picks a free one."""

    def __init__(self, routes: dict[str, Handler], host: str = "127.0.0.1", port: int = 0):
        self.routes = routes
        self.seen: list[tuple[str, str, dict]] = []
        self.stopping = threading.Event()
        outer = self

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def _any(self):
                outer.seen.append((self.command, self.path, dict(self.headers)))
                n = int(self.headers.get("Content-Length") or 0)
                if n:
                    self.rfile.read(n)
                fn = outer.routes.get(self.path.split("?")[0])
                if fn is None:
                    send(self, 404, b"no such path")
                    return
                try:
                    fn(self)
                except (BrokenPipeError, ConnectionResetError):
                    pass

            do_GET = do_POST = _any

        self.httpd = ThreadingHTTPServer((host, port), H)
        self.httpd.daemon_threads = True
        self.url = f"http://{host}:{self.httpd.server_address[1]}"
        # shutdown() is seen at the loop's next look: every 0.05 s, not socketserver's 0.5 s.
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                       daemon=True)

    def __enter__(self) -> HostileServer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stopping.set()
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5)


def send(h: BaseHTTPRequestHandler, status: int, body: bytes, ctype: str = "application/json",
         headers: dict | None = None) -> None:
    h.send_response(status)
    h.send_header("Content-Type", ctype)
    h.send_header("Content-Length", str(len(body)))
    for k, v in (headers or {}).items():
        h.send_header(k, v)
    h.end_headers()
    h.wfile.write(body)


def answer(body: bytes, status: int = 200, ctype: str = "application/json") -> Handler:
    return lambda h: send(h, status, body, ctype)


def redirect(to: str, status: int = 302) -> Handler:
    return lambda h: send(h, status, b"", headers={"Location": to})


def endless(piece: bytes = b"x" * 65536, every_s: float = 0.0, prefix: bytes = b"",
            ctype: str = "application/json") -> Handler:
    """An answer without a length that never ends (until MAX_HANDLER_S or the client leaves)."""
    def fn(h: BaseHTTPRequestHandler) -> None:
        h.send_response(200)
        h.send_header("Content-Type", ctype)
        h.send_header("Connection", "close")
        h.end_headers()
        h.wfile.write(prefix)
        t_end = time.monotonic() + MAX_HANDLER_S
        while time.monotonic() < t_end:
            h.wfile.write(piece)
            h.wfile.flush()
            if every_s:
                time.sleep(every_s)
        h.close_connection = True
    return fn
