"""Small HTTP client helpers (stdlib only) for vLLM's API and the node agents."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass


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

    def json(self):
        return json.loads(self.body)


def request(url: str, *, data: dict | None = None, timeout: float = 5.0, token: str | None = None) -> Response:
    """GET (or POST JSON when `data` is given). Non-2xx answers are returned, not raised;
    no answer at all (refused, timed out, reset) raises HTTPFailure."""
    body = None if data is None else json.dumps(data).encode()
    req = urllib.request.Request(url, data=body, method="POST" if body is not None else "GET")
    if body is not None:
        req.add_header("Content-Type", "application/json")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return Response(r.status, r.read(), time.monotonic() - t0)
    except urllib.error.HTTPError as e:
        try:
            payload = e.read()
        except OSError:
            payload = b""
        return Response(e.code, payload, time.monotonic() - t0)
    except (urllib.error.URLError, OSError, TimeoutError) as e:
        reason = getattr(e, "reason", e)
        raise HTTPFailure(f"{url}: {reason}", refused=isinstance(reason, ConnectionRefusedError)) from None


def get_json(url: str, timeout: float = 5.0, token: str | None = None):
    r = request(url, timeout=timeout, token=token)
    if r.status != 200:
        raise HTTPFailure(f"{url}: HTTP {r.status}")
    try:
        return r.json()
    except ValueError:
        raise HTTPFailure(f"{url}: answer is not JSON") from None
