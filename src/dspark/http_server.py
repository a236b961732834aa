"""The base of dspark's two HTTP servers (the node agent and the dashboard): http.server's
threads, bounded.

- every connection gets a socket timeout (SOCKET_TIMEOUT_S): a client that connects and
  sends nothing, or stops half-way, loses its connection instead of holding a thread;
- at most MAX_CONNECTIONS connections are served at once; one more is closed at once, so a
  flood of idle connections cannot grow the threads without bound;
- a request body the server does not want is read and dropped (up to MAX_DISCARD_BYTES,
  else the connection is closed), so on a keep-alive connection it is never parsed as the
  next request.

These limits are the servers' policy, written only here. (A maintained ASGI server would
bring the same, plus an event loop and its imports into every supervisor; both servers
answer a few small GETs a second, which threads serve well once bounded.)
"""

from __future__ import annotations

import socket
import socketserver
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

SOCKET_TIMEOUT_S = 10.0
MAX_CONNECTIONS = 32
MAX_DISCARD_BYTES = 64 * 1024


class BoundedHTTPServer(ThreadingHTTPServer):
    """ThreadingHTTPServer with a socket timeout per connection and a connection cap; IPv6
    when the host is an IPv6 address."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler]):
        self.timeout_s = SOCKET_TIMEOUT_S
        self.max_connections = MAX_CONNECTIONS
        self._slots = threading.BoundedSemaphore(self.max_connections)
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        super().__init__(address, handler)

    def server_bind(self) -> None:
        """http.server's bind, without its socket.getfqdn(host): a reverse DNS lookup of the
        listening address that nothing here reads, and that on a node without a reachable
        resolver leaves the host (or waits for the resolver's timeout) before the server starts."""
        socketserver.TCPServer.server_bind(self)
        host, port = self.server_address[:2]
        self.server_name, self.server_port = host, port

    def process_request(self, request, client_address) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)  # at the cap: no thread for this one
            return
        try:
            request.settimeout(self.timeout_s)
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


def discard_body(h: BaseHTTPRequestHandler) -> None:
    """Read and drop the request's body, so that a keep-alive connection stays in step; a body
    that is chunked, of unknown or too large a length closes the connection instead."""
    if h.headers.get("Transfer-Encoding"):
        h.close_connection = True
        return
    try:
        left = int(h.headers.get("Content-Length") or 0)
    except ValueError:
        left = -1
    if left < 0 or left > MAX_DISCARD_BYTES:
        h.close_connection = True
        return
    while left > 0:
        chunk = h.rfile.read(min(left, 65536))
        if not chunk:
            h.close_connection = True
            return
        left -= len(chunk)
