"""The base of dspark's two HTTP servers (the node agent and the dashboard): http.server's
threads, bounded.

- a request's head (request line and headers) is read by one selector thread for every
  connection at once, without a thread per connection, within a whole-request deadline
  (SOCKET_TIMEOUT_S from the accept) and MAX_HEAD_BYTES; a client that connects and sends
  nothing, or trickles its head a byte at a time, loses its connection at the deadline. Up
  to MAX_PENDING such connections wait (past that the oldest is dropped), so slow clients,
  however many, never hold a handler thread: 200 of them leave the agent answering;
- only a request whose head is complete gets one of MAX_CONNECTIONS handler threads; one
  more is closed at once, so the threads stay bounded. A handler serves one request and
  closes the connection (no keep-alive: a second request would be read without the
  deadline), and its reads end at the same deadline;
- a request body the server does not want is read and dropped (up to MAX_DISCARD_BYTES,
  else the connection is closed), so on a keep-alive connection it is never parsed as the
  next request.

These limits are the servers' policy, written only here. (A maintained ASGI server would
bring the same, plus an event loop and its imports into every supervisor; both servers
answer a few small GETs a second, which threads serve well once bounded.)
"""

from __future__ import annotations

import io
import selectors
import socket
import socketserver
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, cast

SOCKET_TIMEOUT_S = 10.0  # a whole request, from the accept: its head, its body, the answer's writes
MAX_CONNECTIONS = 32     # handler threads: requests whose head is complete
MAX_PENDING = 1024       # connections still sending their head (no thread each)
MAX_HEAD_BYTES = 16 * 1024
MAX_DISCARD_BYTES = 64 * 1024
STOP_POLL_S = 0.05       # how often the accept loop looks for a stop: a stop waits at most this long


class _Deadlined(io.RawIOBase):
    """A connection's input for the handler: the head already read, then the socket, each read
    bounded by the request's deadline (EOF past it)."""

    def __init__(self, sock: socket.socket, head: bytes, deadline: float):
        self.sock, self.head, self.deadline = sock, head, deadline

    def readable(self) -> bool:
        return True

    def readinto(self, b: memoryview) -> int:  # type: ignore[override]  # typeshed: any writable buffer
        if self.head:
            n = min(len(b), len(self.head))
            b[:n], self.head = self.head[:n], self.head[n:]
            return n
        left = self.deadline - time.monotonic()
        if left <= 0:
            return 0
        try:
            self.sock.settimeout(left)
            return self.sock.recv_into(b)
        except OSError:  # timed out or reset: the end of this request's input
            return 0


class _Connection:
    """The accepted socket as the handler sees it: its makefile('rb') is the _Deadlined input."""

    def __init__(self, sock: socket.socket, head: bytes, deadline: float):
        self._sock, self._head, self._deadline = sock, head, deadline

    def makefile(self, mode: str = "r", buffering: int = -1) -> io.IOBase:
        if "r" in mode:
            return io.BufferedReader(_Deadlined(self._sock, self._head, self._deadline))
        # typeshed's overloads want a Literal mode; this passes on the caller's (a write mode)
        return self._sock.makefile(mode, buffering)  # type: ignore[call-overload]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


class _HeadReader:
    """One thread that reads every pending connection's request head without blocking, and
    hands each complete one to `ready(sock, addr, head, deadline)`."""

    def __init__(self, ready: Callable[[socket.socket, Any, bytes, float], None],
                 drop: Callable[[socket.socket], None], timeout_s: float):
        self.ready, self.drop, self.timeout_s = ready, drop, timeout_s
        self.sel = selectors.DefaultSelector()
        self.pending: OrderedDict[socket.socket, list[Any]] = OrderedDict()  # sock -> [addr, bytes so far, deadline]
        self.lock = threading.Lock()
        self.wake_r, self.wake_w = socket.socketpair()
        self.wake_r.setblocking(False)
        self.sel.register(self.wake_r, selectors.EVENT_READ)
        self.stopping = False
        self.thread = threading.Thread(target=self._run, name="http-heads", daemon=True)
        self.thread.start()

    def add(self, sock: socket.socket, addr: Any) -> None:
        sock.setblocking(False)
        with self.lock:
            if self.stopping:
                self.drop(sock)
                return
            if len(self.pending) >= MAX_PENDING:  # the oldest (slowest) goes, not the newest
                old, _ = self.pending.popitem(last=False)
                self._forget(old)
                self.drop(old)
            self.pending[sock] = [addr, b"", time.monotonic() + self.timeout_s]
            self.sel.register(sock, selectors.EVENT_READ)
        self._wake()

    def _wake(self) -> None:
        try:
            self.wake_w.send(b"\0")
        except OSError:
            pass

    def _forget(self, sock: socket.socket) -> None:
        try:
            self.sel.unregister(sock)
        except (KeyError, ValueError, OSError):
            pass

    def _run(self) -> None:
        while not self.stopping:
            with self.lock:
                first = next(iter(self.pending.values()), None)
            wait = max(0.0, min(1.0, first[2] - time.monotonic())) if first else 1.0
            for key, _ in self.sel.select(wait):
                if key.fileobj is self.wake_r:
                    try:
                        while self.wake_r.recv(4096):
                            pass
                    except OSError:
                        pass
                    continue
                self._read(cast(socket.socket, key.fileobj))  # registered by add(): a socket
            now = time.monotonic()
            with self.lock:
                late = [s for s, (_, _, dl) in self.pending.items() if dl <= now]
                for sock in late:
                    del self.pending[sock]
                    self._forget(sock)
            for sock in late:
                self.drop(sock)

    def _read(self, sock: socket.socket) -> None:
        with self.lock:
            entry = self.pending.get(sock)
        if entry is None:
            return
        try:
            chunk = sock.recv(MAX_HEAD_BYTES)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        head = entry[1] + chunk
        done = b"\r\n\r\n" in head or b"\n\n" in head
        if chunk and not done and len(head) <= MAX_HEAD_BYTES:
            entry[1] = head
            return
        with self.lock:
            self.pending.pop(sock, None)
            self._forget(sock)
        if done and len(head.split(b"\r\n\r\n", 1)[0]) <= MAX_HEAD_BYTES:
            sock.setblocking(True)
            self.ready(sock, entry[0], head, entry[2])
        else:  # closed before its head ended, or a head too large
            self.drop(sock)

    def stop(self) -> None:
        with self.lock:
            self.stopping = True
            socks = list(self.pending)
            self.pending.clear()
        self._wake()
        self.thread.join(timeout=5)
        for sock in socks:
            self.drop(sock)
        self.sel.close()
        self.wake_r.close()
        self.wake_w.close()


class BoundedHTTPServer(ThreadingHTTPServer):
    """ThreadingHTTPServer with a socket timeout per connection and a connection cap; IPv6
    when the host is an IPv6 address."""

    daemon_threads = True
    request_queue_size = 128  # listen backlog: a burst of connections is accepted, not dropped (5)

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler]):
        self.timeout_s = SOCKET_TIMEOUT_S
        self.max_connections = MAX_CONNECTIONS
        self._slots = threading.BoundedSemaphore(self.max_connections)
        if ":" in address[0]:
            self.address_family = socket.AF_INET6

        # one request per connection: the next would escape the deadline. mypy cannot check a class
        # whose base is only known at run time (the handler class passed in).
        class OneRequest(handler):  # type: ignore[valid-type,misc]
            def handle(self) -> None:
                self.close_connection = True
                self.handle_one_request()
                self.close_connection = True

        # Before the bind: a port already taken makes socketserver call server_close(), which
        # stops the reader (it was an AttributeError, and the bind's own error was lost).
        self._heads = _HeadReader(self._head_done, self.shutdown_request, self.timeout_s)
        super().__init__(address, OneRequest)

    def serve_forever(self, poll_interval: float = STOP_POLL_S) -> None:
        """socketserver's loop, which sees shutdown() only between waits: with its default
        wait (0.5 s) every stop of an agent or a dashboard took up to half a second."""
        super().serve_forever(poll_interval)

    def server_bind(self) -> None:
        """http.server's bind, without its socket.getfqdn(host): a reverse DNS lookup of the
        listening address that nothing here reads, and that on a node without a reachable
        resolver leaves the host (or waits for the resolver's timeout) before the server starts."""
        socketserver.TCPServer.server_bind(self)
        host, port = self.server_address[:2]
        self.server_name, self.server_port = cast(str, host), port  # an AF_INET/AF_INET6 name: str host

    def process_request(self, request: socket.socket | tuple[bytes, socket.socket], client_address: Any) -> None:
        self._heads.add(cast(socket.socket, request), client_address)  # no thread until its head is complete

    def _head_done(self, request: socket.socket, client_address: Any, head: bytes, deadline: float) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)  # at the cap: no thread for this one
            return
        try:
            request.settimeout(max(0.1, deadline - time.monotonic()))
            conn = _Connection(request, head, deadline)
            t = threading.Thread(target=self.process_request_thread, args=(conn, client_address), daemon=True)
            t.start()
        except BaseException:
            self._slots.release()
            self.shutdown_request(request)
            raise

    def shutdown_request(self, request: Any) -> None:  # a socket, or the _Connection for one
        sock = request._sock if isinstance(request, _Connection) else request
        super().shutdown_request(sock)

    def server_close(self) -> None:
        self._heads.stop()
        super().server_close()

    def process_request_thread(self, request: Any, client_address: Any) -> None:  # a _Connection
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
