"""ASGI middleware that dspark adds to vLLM's API server (`--middleware dspark_api_guard.GuardEveryRoute`,
with this directory on vLLM's PYTHONPATH; dspark.node.launch does both).

vLLM's own API-key check guards only the paths under /v1: with a key set, /invocations runs
completions and /tokenize, /detokenize, /metrics, /version and the rest answer without it. This
guard asks for the same key (vLLM reads it from VLLM_API_KEY, which dspark's supervisor sets) on
every HTTP and WebSocket route but /health, the liveness route a load balancer polls. CORS
preflights (OPTIONS) pass to vLLM's CORS middleware, which dspark configures with no allowed
origin unless the cluster file names some. Without a key it does nothing, as vLLM does.

It runs inside vLLM's process, so it imports nothing but the standard library and Starlette
(which vLLM's server is built on), on both runtime lines (vLLM 0.28.0 and 0.32.0 load
`--middleware` classes with `app.add_middleware`).
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # ASGI's types, spelled out here: this file imports no dspark and no Starlette types
    from collections.abc import Awaitable, Callable, MutableMapping
    from typing import Any

    Scope = MutableMapping[str, Any]
    Message = MutableMapping[str, Any]
    Receive = Callable[[], Awaitable[Message]]
    Send = Callable[[Message], Awaitable[None]]
    ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

OPEN_PATHS = frozenset({"/health"})
KEY_ENV = "VLLM_API_KEY"


def _digest(text: str) -> bytes:
    return hashlib.sha256(text.encode("utf-8")).digest()


class GuardEveryRoute:
    """Answer 401 to a request on any route but OPEN_PATHS without `Authorization: Bearer <key>`."""

    def __init__(self, app: ASGIApp, key: str | None = None) -> None:
        self.app = app
        key = os.environ.get(KEY_ENV) if key is None else key
        self.key = _digest(key) if key else None

    def _allowed(self, scope: Scope, key: bytes) -> bool:
        for name, value in scope.get("headers") or ():
            if name.lower() == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                return scheme.lower() == "bearer" and secrets.compare_digest(_digest(token.strip()), key)
        return False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        key = self.key
        if key is None or scope.get("type") not in ("http", "websocket") or scope.get("method") == "OPTIONS":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        root = scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root):]
        if path.rstrip("/") in OPEN_PATHS or self._allowed(scope, key):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        body = json.dumps({"error": "Unauthorized"}).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})
