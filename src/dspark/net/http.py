"""The one HTTP client of dspark (httpx), for vLLM's API and the node agents.

Every client goes through here: bench, status, wait-worker, the dashboard's collector and the
supervisor's probes. httpx rather than urllib because it closes three classes of defect:

- a redirect to another origin (scheme, host or port) drops the `Authorization` header, so
  the API key never follows a redirect to another host (urllib kept it);
- connect, read and write timeouts, plus one overall deadline per request, from the connect
  through the answer's head to its last byte: every read and write of the connection waits
  at most what is left of it (`_DeadlineBackend`), so a server that trickles its status line,
  headers or body a byte at a time cannot hold a caller past it;
- bodies are streamed and refused past `MAX_BODY_BYTES` (`MAX_LINE_BYTES` per line of an
  event stream) instead of being read into memory whole.

Bodies are read as sent: requests say `Accept-Encoding: identity`, and an answer sent with
any other Content-Encoding is refused unread, never inflated (httpx inflates a whole chunk at
once: a 2 KB `gzip, gzip` answer became 1 GiB before a cap on the body could look at it).

Every JSON answer is parsed by `parse_json`, with a size and a nesting bound: a peer's
hostile answer (`[[[[...` nested past the interpreter's recursion limit) is refused as a
ValueError (`JSONRefused`), never a RecursionError that escapes the caller.

These limits are dspark's HTTP policy, written only here.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from dspark.files.safe_read import MAX_JSON_DEPTH, JSONRefused
from dspark.files.safe_read import parse_json as _parse_json

if TYPE_CHECKING:  # annotations only: at run time httpx is imported where it is used
    import ssl

    import httpcore
    import httpx

__all__ = ["HTTPFailure", "JSONRefused", "MAX_BODY_BYTES", "MAX_STATE_BYTES", "Response", "Stream", "get_json",
           "get_object", "parse_json", "request", "stream"]

MAX_BODY_BYTES = 16 * 1024 * 1024   # any one answer (vLLM's /metrics is a few hundred KiB)
MAX_LINE_BYTES = 1024 * 1024        # one line of a server-sent event stream
MAX_REDIRECTS = 5
MAX_STATE_BYTES = 1024 * 1024       # an agent's /state is a few KiB
IDENTITY = "identity"               # the only Content-Encoding read


def parse_json(text: bytes | str, *, max_bytes: int = MAX_BODY_BYTES, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """A peer's JSON answer within dspark.files.safe_read's bounds (JSONRefused, a ValueError, if not)."""
    return _parse_json(text, max_bytes=max_bytes, max_depth=max_depth)


class HTTPFailure(Exception):
    """A request that did not produce the expected answer; the message says why.

    `refused` is True when nothing listens on the port (the process is gone), as opposed
    to a timeout or a reset (it may be busy, or the network slow)."""

    def __init__(self, message: str, refused: bool = False):
        super().__init__(message)
        self.refused = refused


@dataclass
class Response:
    status: int
    body: bytes
    elapsed_s: float

    def json(self, max_depth: int = MAX_JSON_DEPTH) -> Any:
        """The body as JSON within `parse_json`'s bounds; JSONRefused (a ValueError) if not."""
        return parse_json(self.body, max_depth=max_depth)


class _DeadlinePassed(Exception):
    """A request's overall deadline passed (raised in the connection's reads and writes)."""


# The deadline (time.monotonic()) of the request this thread is sending: read by
# _DeadlineBackend when the request's connection opens (one connection per request: no keep-alive).
_deadline: ContextVar[float] = ContextVar("dspark_http_deadline", default=math.inf)


def _left(deadline: float, timeout: float | None) -> float | None:
    """A step's timeout cut to what is left of the deadline; _DeadlinePassed when nothing is."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise _DeadlinePassed
    if left == math.inf or (timeout is not None and timeout < left):
        return timeout
    return left


def _by_deadline(deadline: float, step: Callable[..., Any], timeout: float | None, *args: Any, **kwargs: Any) -> Any:
    """`step(*args, timeout=..., **kwargs)` within the deadline; a timeout at or past it is the
    deadline's."""
    import httpcore

    try:
        return step(*args, timeout=_left(deadline, timeout), **kwargs)
    except httpcore.TimeoutException:
        if time.monotonic() >= deadline:
            raise _DeadlinePassed from None
        raise


class _DeadlineStream:
    """One connection (httpcore's NetworkStream interface) whose every read and write waits at
    most what is left of its request's deadline: a byte at a time no longer resets the clock."""

    def __init__(self, inner: httpcore.NetworkStream, deadline: float) -> None:
        self._inner, self._deadline = inner, deadline

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return _by_deadline(self._deadline, self._inner.read, timeout, max_bytes)

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        _by_deadline(self._deadline, self._inner.write, timeout, buffer)

    def close(self) -> None:
        self._inner.close()

    def start_tls(self, ssl_context: ssl.SSLContext, server_hostname: str | None = None,
                  timeout: float | None = None) -> _DeadlineStream:
        tls = _by_deadline(self._deadline, self._inner.start_tls, timeout, ssl_context, server_hostname)
        return _DeadlineStream(tls, self._deadline)

    def get_extra_info(self, info: str) -> Any:
        return self._inner.get_extra_info(info)


class _DeadlineBackend:
    """httpcore's network backend, with the connect and the connection bound by the deadline of
    the request that opens it."""

    def __init__(self, inner: httpcore.NetworkBackend) -> None:
        self._inner = inner

    def connect_tcp(self, host: str, port: int, timeout: float | None = None, local_address: str | None = None,
                    socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None) -> _DeadlineStream:
        deadline = _deadline.get()
        sock = _by_deadline(deadline, self._inner.connect_tcp, timeout, host, port,
                            local_address=local_address, socket_options=socket_options)
        return _DeadlineStream(sock, deadline)

    def connect_unix_socket(self, path: str, timeout: float | None = None,
                            socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None) -> _DeadlineStream:
        deadline = _deadline.get()
        sock = _by_deadline(deadline, self._inner.connect_unix_socket, timeout, path,
                            socket_options=socket_options)
        return _DeadlineStream(sock, deadline)

    def sleep(self, seconds: float) -> None:
        self._inner.sleep(seconds)


_client: httpx.Client | None = None


def client() -> httpx.Client:
    """The process's httpx client (built once, on first use: importing httpx costs ~0.1 s,
    which `dspark --help` must not pay). No keep-alive: every request opens its own
    connection, so a restarted server is seen as such (a refused connection), and a
    connection serves one request, within that request's deadline. No proxy from the
    environment: dspark talks to its own nodes."""
    global _client
    if _client is None:
        import httpcore
        import httpx

        transport = httpx.HTTPTransport()
        # httpx has no argument for httpcore's network backend, so its pool is built here with
        # the same (public) settings and the deadline's backend; tests/test_http_bomb.py proves it.
        # (_DeadlineBackend implements NetworkBackend's interface without subclassing it.)
        backend = cast("httpcore.NetworkBackend", _DeadlineBackend(httpcore.SyncBackend()))
        transport._pool = httpcore.ConnectionPool(ssl_context=httpx.create_ssl_context(), max_connections=None,
                                                  max_keepalive_connections=0, network_backend=backend)
        _client = httpx.Client(follow_redirects=True, max_redirects=MAX_REDIRECTS, transport=transport,
                               headers={"Accept-Encoding": IDENTITY})
    return _client


def _refused(exc: BaseException) -> bool:
    seen = 0
    e: BaseException | None = exc
    while e is not None and seen < 10:
        if isinstance(e, ConnectionRefusedError):
            return True
        e, seen = e.__cause__ or e.__context__, seen + 1
    return False


def _reason(exc: BaseException) -> str:
    import httpx

    if isinstance(exc, httpx.TimeoutException):
        return "timed out"
    if _refused(exc):
        return "[Errno 111] Connection refused"
    if isinstance(exc, httpx.TooManyRedirects):
        return f"more than {MAX_REDIRECTS} redirects"
    if isinstance(exc, (httpx.UnsupportedProtocol, httpx.InvalidURL)):
        return f"not a usable http(s) URL ({exc})"
    return str(exc) or type(exc).__name__


def _failure(url: str, exc: BaseException) -> HTTPFailure:
    return HTTPFailure(f"{url}: {_reason(exc)}", refused=_refused(exc))


def _late(url: str, budget_s: float) -> HTTPFailure:
    return HTTPFailure(f"{url}: no complete answer within its {budget_s:g} s deadline")


def _encoded(resp: httpx.Response) -> str | None:
    """The answer's Content-Encoding when it is not identity (the body is then refused)."""
    codings = [c.strip().lower() for v in resp.headers.get_list("content-encoding") for c in v.split(",")]
    return ", ".join(codings) if any(c not in ("", IDENTITY) for c in codings) else None


@dataclass
class Stream:
    """An open response whose body is read through `lines()` or `read()`, within limits."""

    url: str
    status: int
    _resp: httpx.Response
    _deadline: float
    _budget_s: float

    def _chunks(self) -> Iterator[bytes]:
        import httpx

        try:
            for chunk in self._resp.iter_raw():  # as sent: stream() refused any encoding
                if time.monotonic() > self._deadline:
                    raise _late(self.url, self._budget_s)
                yield chunk
        except _DeadlinePassed:
            raise _late(self.url, self._budget_s) from None
        except httpx.HTTPError as e:
            raise _failure(self.url, e) from None

    def read(self, max_bytes: int = MAX_BODY_BYTES) -> bytes:
        body = bytearray()
        for chunk in self._chunks():
            body += chunk
            if len(body) > max_bytes:
                raise HTTPFailure(f"{self.url}: answer larger than {max_bytes:,} bytes")
        return bytes(body)

    def lines(self, max_line: int = MAX_LINE_BYTES) -> Iterator[bytes]:
        """The body's lines (without the line end), each at most `max_line` bytes."""
        buf = b""
        for chunk in self._chunks():
            buf += chunk
            while True:
                cut = buf.find(b"\n")
                if cut < 0:
                    break
                line, buf = buf[:cut], buf[cut + 1:]
                yield line.rstrip(b"\r")
            if len(buf) > max_line:
                raise HTTPFailure(f"{self.url}: a line longer than {max_line:,} bytes")
        if buf:
            yield buf.rstrip(b"\r")


@contextmanager
def stream(url: str, *, data: dict | None = None, timeout: float = 5.0, deadline_s: float | None = None,
           token: str | None = None, headers: dict | None = None) -> Iterator[Stream]:
    """Open a GET (or a JSON POST when `data` is given) and yield its Stream. `timeout` bounds
    each network step (connect, each read); `deadline_s` (default: `timeout`) the whole
    request, from the connect through the answer's head to its last byte."""
    import httpx

    hdrs = dict(headers or {})
    if token:
        hdrs["Authorization"] = f"Bearer {token}"
    budget = timeout if deadline_s is None else deadline_s
    deadline = time.monotonic() + budget
    mark = _deadline.set(deadline)
    try:
        req = client().build_request("POST" if data is not None else "GET", url, json=data, headers=hdrs,
                                     timeout=httpx.Timeout(timeout))
        resp = client().send(req, stream=True)
    except _DeadlinePassed:
        raise _late(url, budget) from None
    except (httpx.HTTPError, httpx.InvalidURL) as e:
        raise _failure(url, e) from None
    finally:
        _deadline.reset(mark)
    try:
        encoding = _encoded(resp)
        if encoding is not None:
            raise HTTPFailure(f"{url}: answer sent with Content-Encoding {encoding!r}, refused unread "
                              f"(dspark asks for {IDENTITY} and inflates nothing)")
        yield Stream(url, resp.status_code, resp, deadline, budget)
    finally:
        resp.close()


def request(url: str, *, data: dict | None = None, timeout: float = 5.0, token: str | None = None,
            max_bytes: int = MAX_BODY_BYTES) -> Response:
    """GET (or POST JSON when `data` is given). Non-2xx answers are returned, not raised;
    no answer at all (refused, timed out, reset, too large) raises HTTPFailure."""
    t0 = time.monotonic()
    with stream(url, data=data, timeout=timeout, token=token) as s:
        body = s.read(max_bytes)
        return Response(s.status, body, time.monotonic() - t0)


def get_json(url: str, timeout: float = 5.0, token: str | None = None, max_bytes: int = MAX_BODY_BYTES) -> Any:
    """A 200 answer's JSON value (at most `max_bytes`, MAX_JSON_DEPTH deep); HTTPFailure if not."""
    r = request(url, timeout=timeout, token=token, max_bytes=max_bytes)
    if r.status != 200:
        raise HTTPFailure(f"{url}: HTTP {r.status}")
    try:
        return r.json()
    except JSONRefused as e:
        raise HTTPFailure(f"{url}: answer refused: {e}") from None


def get_object(url: str, timeout: float = 5.0, token: str | None = None, max_bytes: int = MAX_BODY_BYTES) -> dict:
    """get_json for answers that must be a JSON object (an agent's /state, vLLM's /version):
    anything else is an HTTPFailure, never a crash in the caller."""
    value = get_json(url, timeout=timeout, token=token, max_bytes=max_bytes)
    if not isinstance(value, dict):
        raise HTTPFailure(f"{url}: answer is JSON but not an object")
    return value
