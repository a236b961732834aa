"""The server under test: its address, what it says about itself, and one streamed
completion timed on the client side (through dspark.net.http: bounded bodies and lines, an
overall deadline per request; threads keep one stream per concurrent request).

Whatever the server answers (JSON that is not an object, a chunk of the wrong shape, more
tokens than asked for, a stream that never ends) is a BenchError that says so."""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from dspark.engine import facts as F
from dspark.engine import metrics
from dspark.net import http
from dspark.net.http import HTTPFailure, Response, parse_json, request


class BenchError(Exception):
    """A benchmark that cannot go on (server unreachable, failing or unsuitable); the
    message says what happened and is shown as is."""


REQUEST_TIMEOUT_S = 600.0  # per request, from sending it to the end of its stream (`--request-timeout`)


@dataclass(frozen=True)
class Target:
    url: str                  # e.g. http://10.0.0.1:8888 (no trailing slash)
    model: str | None = None  # served name; None = the server's only model
    token: str | None = None  # API key, sent as a Bearer token
    timeout_s: float = REQUEST_TIMEOUT_S

    def endpoint(self, path: str) -> str:
        return self.url.rstrip("/") + path


@dataclass
class ServerInfo:
    url: str
    model: str
    runtime_version: str | None
    max_model_len: int | None
    settings: dict = field(default_factory=dict)


API_KEY_HINT = "the server wants an API key: set DSPARK_API_KEY (or VLLM_API_KEY)"


def _fetch(target: Target, path: str, timeout: float) -> Response:
    """GET `path` within `timeout` and the target's own (`--request-timeout` bounds every
    request); anything but a 200 answer is a BenchError that says why."""
    try:
        r = request(target.endpoint(path), timeout=min(timeout, target.timeout_s), token=target.token)
    except HTTPFailure as e:
        raise BenchError(f"server unreachable or failing: {e}") from None
    if r.status == 401:
        raise BenchError(f"{target.endpoint(path)}: HTTP 401: {API_KEY_HINT}")
    if r.status != 200:
        raise BenchError(f"server failing: {target.endpoint(path)}: HTTP {r.status}")
    return r


def _get(target: Target, path: str, timeout: float = 10.0) -> Any:
    r = _fetch(target, path, timeout)
    try:
        return r.json()
    except ValueError:
        raise BenchError(f"{target.endpoint(path)}: answer is not JSON") from None


def describe(target: Target) -> ServerInfo:
    """Runtime version (/version), the served model and its max_model_len (/v1/models), and
    the KV-cache settings vLLM publishes in /metrics."""
    models = _get(target, F.MODELS)
    data = models.get("data") if isinstance(models, dict) else None
    entries = [m for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)] \
        if isinstance(data, list) else []
    names = [m["id"] for m in entries]
    if target.model is None:
        if len(names) != 1:
            raise BenchError(f"{target.url} serves {names or 'no models'}; name one with --model")
        entry = entries[0]
    else:
        matches = [m for m in entries if m["id"] == target.model]
        if not matches:
            raise BenchError(f"{target.url} does not serve model {target.model!r}; it serves {names}")
        entry = matches[0]
    try:
        version = _get(target, F.VERSION).get("version")
    except (BenchError, AttributeError):
        version = None
    if not isinstance(version, str):
        version = None
    max_len = entry.get(F.MODELS_MAX_LEN_FIELD)
    if not (isinstance(max_len, int) and not isinstance(max_len, bool) and max_len > 0):
        max_len = None
    info = ServerInfo(url=target.url, model=entry["id"], runtime_version=version,
                      max_model_len=int(max_len) if max_len is not None else None)
    try:
        snap = scrape(target, entry["id"])
        cache = snap.info(F.CACHE_CONFIG_INFO)
        if cache:
            info.settings["cache_config"] = {k: v for k, v in sorted(cache.items())
                                             if k not in (F.ENGINE_LABEL, F.MODEL_LABEL)}
    except BenchError:
        pass  # metrics are checked again (and reported) where a benchmark needs them
    return info


def scrape(target: Target, model: str | None = None) -> metrics.Snapshot:
    r = _fetch(target, F.METRICS, timeout=30.0)
    try:
        return metrics.parse_samples(r.body.decode("utf-8", "replace"), model=model)
    except (ValueError, TypeError, IndexError) as e:  # prometheus_client's parser on garbage
        raise BenchError(f"{target.endpoint(F.METRICS)}: not Prometheus text ({e})") from None


@dataclass
class StreamResult:
    """One streamed completion as the client saw it (perf_counter seconds)."""

    started: float
    first_token: float | None = None       # first chunk that carried a choice
    finished: float | None = None
    chunk_times: list[float] = field(default_factory=list)  # arrival of every choice chunk
    prompt_tokens: int | None = None        # from the final usage chunk
    completion_tokens: int | None = None

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.started

    @property
    def e2e_s(self) -> float | None:
        return None if self.finished is None else self.finished - self.started

    @property
    def itl_s(self) -> list[float]:
        """Gaps between consecutive chunks after the first (vllm bench serve's ITL)."""
        t = self.chunk_times
        return [b - a for a, b in zip(t, t[1:], strict=False)]


def _error_message(body: bytes) -> str:
    try:
        err = parse_json(body).get("error")
        if isinstance(err, dict):
            return err.get("message") or str(err)
        return str(err or body[:300])
    except (ValueError, AttributeError):
        return body[:300].decode("utf-8", "replace")


# A choice chunk carries at least one token; a stream with more lines than this (per token
# asked for) is a server that ignores max_tokens or never ends.
MAX_LINES_PER_TOKEN = 8
MAX_EXTRA_LINES = 64


def _count(value: object, what: str, where: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise BenchError(f"{where}: usage.{what} is not a token count: {value!r}")
    return value


def new_cache_salt() -> str:
    """A run's prefix-cache salt: 256 random bits, as vLLM's `cache_salt` asks for."""
    return secrets.token_urlsafe(32)


def completion_body(model: str, prompt: list[int] | tuple[int, ...], max_tokens: int, *, ignore_eos: bool = True,
                    temperature: float = 0.0, cache_salt: str | None = None) -> dict:
    """The JSON body of a streamed token-id completion. `cache_salt` (vLLM's request field)
    keys the prompt's prefix-cache blocks: a run with a salt of its own never reuses the
    blocks an earlier run of the same prompts left behind."""
    body = {
        "model": model,
        "prompt": list(prompt),
        "max_tokens": max_tokens,
        "temperature": temperature,
        "ignore_eos": ignore_eos,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    return body


def stream_completion(target: Target, model: str, prompt: list[int] | tuple[int, ...], max_tokens: int,
                      *, ignore_eos: bool = True, temperature: float = 0.0,
                      cache_salt: str | None = None) -> StreamResult:
    """POST a token-id prompt to /v1/completions with stream=true (completion_body) and time
    every chunk. The whole request, stream included, must end within target.timeout_s."""
    where = target.endpoint(F.COMPLETIONS)
    body = completion_body(model, prompt, max_tokens, ignore_eos=ignore_eos, temperature=temperature,
                           cache_salt=cache_salt)
    max_lines = MAX_LINES_PER_TOKEN * max_tokens + MAX_EXTRA_LINES
    result = StreamResult(started=time.perf_counter())
    try:
        with http.stream(where, data=body, timeout=target.timeout_s, token=target.token,
                         headers={"Accept": "text/event-stream"}) as resp:
            if resp.status != 200:
                hint = f" ({API_KEY_HINT})" if resp.status == 401 else ""
                raise BenchError(f"server failing: {where}: HTTP {resp.status}: "
                                 f"{_error_message(resp.read(64 * 1024))}{hint}")
            done = False
            for n, line in enumerate(resp.lines()):
                if n > max_lines:
                    raise BenchError(f"{where}: the stream went on past {max_lines} lines for {max_tokens} "
                                     "tokens; the server ignores max_tokens")
                now = time.perf_counter()
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue  # blank separators and SSE comments
                data = line[5:].strip()
                if data == b"[DONE]":
                    done = True
                    break
                chunk = parse_json(data)
                if not isinstance(chunk, dict):
                    raise BenchError(f"{where}: a stream chunk is not a JSON object: {data[:80]!r}")
                if "error" in chunk:
                    raise BenchError(f"{where}: the server failed mid-stream: {_error_message(data)}")
                choices = chunk.get("choices")
                if choices is not None and not isinstance(choices, list):
                    raise BenchError(f"{where}: a stream chunk's choices is not a list: {data[:80]!r}")
                if choices:
                    if result.first_token is None:
                        result.first_token = now
                    result.chunk_times.append(now)
                    if len(result.chunk_times) > max_tokens + 1:  # + a closing chunk
                        raise BenchError(f"{where}: more than {max_tokens} tokens streamed for max_tokens="
                                         f"{max_tokens}; the server ignores max_tokens")
                usage = chunk.get("usage")
                if usage is not None and not isinstance(usage, dict):
                    raise BenchError(f"{where}: a stream chunk's usage is not a JSON object: {data[:80]!r}")
                if usage:
                    result.prompt_tokens = _count(usage.get("prompt_tokens"), "prompt_tokens", where)
                    result.completion_tokens = _count(usage.get("completion_tokens"), "completion_tokens", where)
            if not done:
                raise BenchError(f"{where}: the stream ended early (no [DONE]); the server may have died")
        result.finished = result.chunk_times[-1] if result.chunk_times else time.perf_counter()
    except HTTPFailure as e:
        raise BenchError(f"server unreachable or failing: {e}") from None
    except ValueError as e:
        raise BenchError(f"{where}: unreadable answer: {e}") from None
    return result
