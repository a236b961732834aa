"""What the supervisor asks of the outside world, each answer a value: vLLM's /health, a real
1-token completion, vLLM's progress counters on /metrics, its version, and the peers' agents.

Every probe can block for its timeout, so none runs in the supervisor's loop: `Background`
runs one at a time in a thread and hands its result back to the loop, which keeps acting on
signals meanwhile."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar
from urllib.parse import urlsplit

from dspark.engine import facts as vllm_facts
from dspark.net.http import HTTPFailure, get_object, request
from dspark.node.agent_client import AgentAnswer, fetch_state
from dspark.node.events import ReadyProbe, Round
from dspark.node.liveness import LivenessJudge, Progress, read_progress
from dspark.node.port_owner import foreign_listener
from dspark.node.states import Liveness

T = TypeVar("T")


class VllmProbes:
    """Probes of one node's vLLM API (the head's). With `group` (the process group of the vLLM
    the supervisor started), no probe is sent while the API port's listener is another process's
    (dspark.node.port_owner): it would get the API key with the probe and pass for vLLM; `foreign`
    then says who holds the port."""

    def __init__(self, api_url: str, served_name: str, api_key: str | None = None,
                 group: Callable[[], int | None] | None = None):
        self.api_url = api_url.rstrip("/")
        self.served_name = served_name
        self.api_key = api_key
        self.group = group
        self.port = urlsplit(self.api_url).port or 80
        self.foreign: str | None = None

    def _ours(self) -> bool:
        """The API port is ours to probe (nobody else listens on it)."""
        if self.group is None:
            return True
        group = self.group()
        self.foreign = None if group is None else foreign_listener(self.port, group)
        return group is not None and self.foreign is None

    def health(self, timeout: float = 1.0) -> bool:
        if not self._ours():
            return False
        try:
            return request(self.api_url + vllm_facts.HEALTH, timeout=timeout, token=self.api_key).status == 200
        except HTTPFailure:
            return False

    def one_token(self, timeout: float) -> Liveness:
        """A real 1-token completion (a token-id prompt works with or without a tokenizer)."""
        body = {"model": self.served_name, "prompt": [0], "max_tokens": 1, "temperature": 0}
        t0 = time.time()
        if not self._ours():
            return Liveness(ok=False, at=t0, error=self.foreign or "vLLM is not running")
        try:
            r = request(self.api_url + vllm_facts.COMPLETIONS, data=body, timeout=timeout, token=self.api_key)
        except HTTPFailure as e:
            return Liveness(ok=False, at=t0, error=str(e))
        if r.status != 200:
            return Liveness(ok=False, at=t0, latency_s=r.elapsed_s, error=f"completion: HTTP {r.status}")
        try:
            ok = bool(r.json()["choices"])
        except (ValueError, KeyError, TypeError):
            ok = False
        return Liveness(ok=ok, at=t0, latency_s=r.elapsed_s, error=None if ok else "completion: bad answer")

    def progress(self, timeout: float) -> Progress | None:
        """vLLM's work counters from /metrics, or None when there is no usable answer."""
        if not self._ours():
            return None
        try:
            r = request(self.api_url + vllm_facts.METRICS, timeout=timeout, token=self.api_key)
            return read_progress(r.body.decode("utf-8", "replace")) if r.status == 200 else None
        except (HTTPFailure, ValueError):
            return None

    def version(self, timeout: float = 2.0) -> str | None:
        if not self._ours():
            return None
        try:
            v = get_object(self.api_url + vllm_facts.VERSION, timeout=timeout, token=self.api_key).get("version")
        except (HTTPFailure, AttributeError):
            return None
        return v if isinstance(v, str) else None


def ready_probe(probes: VllmProbes, timeout: float) -> ReadyProbe:
    if not probes.health():
        return ReadyProbe(False)
    live = probes.one_token(timeout)
    if not live.ok:
        return ReadyProbe(True, live)
    return ReadyProbe(True, live, probes.progress(timeout), probes.version())


def liveness_round(judge: LivenessJudge, probes: VllmProbes, timeout: float,
                   clock: Callable[[], float] = time.monotonic) -> Round:
    """Read the counters; probe only if the judge asks (dspark.node.liveness)."""
    before = probes.progress(timeout)
    verdict = judge.observe(before, clock())
    probe = None
    if verdict.need_probe:
        probe = probes.one_token(timeout)
        # A second reading shows whether the engine worked meanwhile (and sets the baseline
        # past the probe's own tokens); pointless when /metrics gave nothing before.
        after = probes.progress(timeout) if before is not None else None
        verdict = judge.probed(probe.ok, probe.error, probe.latency_s, after, clock())
    return Round(verdict, probe, clock())


def poll_agents(urls: dict[str, str], timeout: float = 1.0) -> dict[str, AgentAnswer]:
    """Every named agent's answer (one after the other: there is one peer per node pair)."""
    return {name: fetch_state(url, timeout) for name, url in urls.items()}


class Background(Generic[T]):
    """At most one run of a blocking call at a time, in a daemon thread; the result is taken
    once by the loop (`take`). `on_done` (e.g. waking the loop) runs when the call has ended."""

    def __init__(self, name: str, on_done: Callable[[], None] | None = None):
        self.name = name
        self.on_done = on_done
        self._thread: threading.Thread | None = None
        self._done = threading.Event()
        self._result: list[T] = []

    @property
    def busy(self) -> bool:
        return self._thread is not None

    def start(self, fn: Callable[[], T]) -> None:
        if self._thread is not None:
            return
        self._done.clear()

        def run() -> None:
            try:
                self._result.append(fn())
            finally:
                self._done.set()
                if self.on_done is not None:
                    self.on_done()

        self._thread = threading.Thread(target=run, name=self.name, daemon=True)
        self._thread.start()

    def take(self) -> tuple[bool, T | None]:
        """(True, result) once the run has ended (None if it raised); (False, None) otherwise."""
        if self._thread is None or not self._done.is_set():
            return False, None
        self._thread = None
        return (True, self._result.pop()) if self._result else (True, None)
