"""Is the head's engine alive? Judged on progress while it works, by a probe while it idles.

A 1-token completion queues behind user traffic like any other request: on a saturated
server it times out although the engine is busy and healthy. So while requests are running
or waiting, the proof of life is vLLM's own figures on /metrics moving: the prompt and
generated token counters, and the KV-cache usage. The usage matters for long prompts: vLLM
0.28.0 counts a prompt's tokens only once its whole prefill is done (a 350,000-token prompt
is minutes of chunks on two GB10 nodes), but every engine step reports the scheduler's
figures, and each prefill chunk allocates KV blocks. A **stall** is work queued or running
with none of them moving for `stall_s`. Only when the engine is idle (nothing queued, nothing advanced since the last
look) does a real 1-token completion prove it, as before (vLLM's /health kept answering
after a worker died; a wedged collective leaves /health and /metrics answering too).

A probe that fails while the counters advanced meanwhile (traffic arrived and starved it)
does not count against the engine. `LivenessJudge` is the policy alone, pure and driven by
the caller's clock: the supervisor feeds it readings and acts on its verdicts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeGuard

from dspark.engine import facts as F

PROGRESS = "progress"
PROBE = "probe"


@dataclass(frozen=True)
class Progress:
    """One reading of the engine's own counters (from one /metrics answer)."""

    running: float
    waiting: float
    work: float                  # prompt + generated tokens, since the API server started
    kv_usage: float = 0.0        # KV-cache usage (0..1): moves with every prefill chunk
    started: float | None = None  # the API server's process start (a restart resets counters)

    @property
    def busy(self) -> bool:
        return self.running + self.waiting > 0

    def moved_since(self, prev: Progress | None) -> TypeGuard[Progress]:
        """Whether the engine worked between `prev` and this reading: tokens counted or the KV
        usage changed, on the same API server (a restart resets the counters: not progress).
        True only with a `prev` (a plain bool; the TypeGuard tells mypy that prev is not None then)."""
        return (prev is not None and prev.started == self.started and self.work >= prev.work
                and (self.work > prev.work or self.kv_usage != prev.kv_usage))


def read_progress(text: str) -> Progress:
    """Parse vLLM's /metrics text; raises ValueError when it is not a serving vLLM's page."""
    from dspark.engine.metrics import MetricsError, parse

    try:
        s = parse(text, 0.0)
    except MetricsError as e:
        raise ValueError(str(e)) from None
    return Progress(running=s.gauges.get(F.RUNNING, 0.0), waiting=s.gauges.get(F.WAITING, 0.0),
                    work=(s.counters.get(F.PROMPT_TOKENS) or 0.0) + (s.counters.get(F.GENERATION_TOKENS) or 0.0),
                    kv_usage=s.gauges.get(F.KV_USAGE, 0.0), started=s.process_start)


@dataclass(frozen=True)
class Proof:
    """The last evidence that the engine was alive: which kind, when (the caller's clock), what."""

    kind: str     # PROGRESS or PROBE
    at: float
    detail: str


@dataclass(frozen=True)
class Verdict:
    alive: bool
    need_probe: bool = False
    reason: str = ""     # why not alive (a stall, failed probes)
    dead: bool = False   # give up: the engine is stalled or failed its probes


class LivenessJudge:
    """The liveness policy. Feed it `observe` each round; when it asks, `probed`."""

    def __init__(self, *, stall_s: float, probe_failures: int, fresh_s: float):
        self.stall_s = stall_s
        self.probe_failures = probe_failures
        self.fresh_s = fresh_s        # a proof older than this no longer keeps the watchdog fed
        self.last: Progress | None = None
        self.since: float | None = None      # start of the current no-progress stretch while busy
        self.failures = 0
        self.proof: Proof | None = None
        self.alive_at: float | None = None   # the last round that found the engine alive

    # ---------------------------------------------------------------- readings
    def observe(self, p: Progress | None, now: float) -> Verdict:
        """One /metrics reading (None: no usable answer). Decides, or asks for a probe."""
        prev, self.last = self.last, p
        if p is None:
            self.since = None
            return Verdict(alive=False, need_probe=True, reason="no usable /metrics answer")
        if p.moved_since(prev):
            self.since = now if p.busy else None
            moved = (f"{p.work - prev.work:,.0f} tokens" if p.work > prev.work
                     else f"KV cache {prev.kv_usage:.2%} -> {p.kv_usage:.2%} (prefill)")
            return self._alive(PROGRESS, now, f"{moved} since the last look; "
                                              f"{p.running:.0f} running, {p.waiting:.0f} waiting")
        if not p.busy:
            self.since = None
            return Verdict(alive=False, need_probe=True, reason="idle")
        # Busy and nothing advanced since the last look (or nothing to compare with yet).
        if self.since is None:
            self.since = now
        stalled_for = now - self.since
        if stalled_for >= self.stall_s:
            return Verdict(alive=False, dead=True,
                           reason=f"engine stalled: {p.running:.0f} running, {p.waiting:.0f} waiting, "
                                  f"no token processed for {stalled_for:.0f} s (stall_s {self.stall_s:g})")
        # Within the stall window the engine keeps the benefit of the doubt (a long prefill
        # chunk advances nothing until it ends); the proof on record stays the last real one.
        self.alive_at = now
        return Verdict(alive=True)

    def probed(self, ok: bool, error: str | None, latency_s: float | None, after: Progress | None,
               now: float) -> Verdict:
        """The result of the 1-token completion the last `observe` asked for. `after` is a
        /metrics reading taken after a failed probe (None if unavailable or not taken)."""
        before = self.last
        if after is not None:
            # The next look compares with this reading: the probe's own tokens are not progress.
            self.last = after
        if ok:
            return self._alive(PROBE, now, f"1-token completion in {latency_s:.2f} s" if latency_s is not None
                               else "1-token completion")
        if after is not None and after.moved_since(before):
            # Traffic arrived while the probe waited and the engine worked through it.
            return self._alive(PROGRESS, now, f"probe starved by traffic ({error}); "
                                              f"{after.work - before.work:,.0f} tokens processed meanwhile")
        self.failures += 1
        reason = f"liveness probe failed ({self.failures}/{self.probe_failures}): {error}"
        return Verdict(alive=False, reason=reason, dead=self.failures >= self.probe_failures)

    def _alive(self, kind: str, now: float, detail: str) -> Verdict:
        self.failures = 0
        self.proof = Proof(kind, now, detail)
        self.alive_at = now
        return Verdict(alive=True)

    # ---------------------------------------------------------------- for the watchdog
    def fed(self, now: float) -> bool:
        """Whether the last round that found the engine alive is recent enough to ping."""
        return self.alive_at is not None and now - self.alive_at <= self.fresh_s
