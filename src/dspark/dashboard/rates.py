"""Two scrapes -> rates and latency figures (pure).

A counter that went down, or a new `process_start_time_seconds`, means vLLM restarted: its
counters count again from zero, so the delta over that interval is the new value itself (as
Prometheus' rate() does). A rate is therefore never negative.
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import vllm_facts as F
from ..vllm_metrics import Histogram, Scrape, SpecDecode, spec_decode_of

# The head's liveness probe (supervisor.one_token) sends a 1-token prompt and generates one
# token every few seconds. An interval with no more tokens than that and no running request
# is idle, so the probe does not drag the "active" averages towards zero.
PROBE_TOKENS = 1


def is_reset(old: Scrape, cur: Scrape) -> bool:
    if old.process_start is not None and cur.process_start is not None and old.process_start != cur.process_start:
        return True
    if any(cur.counters.get(n, 0.0) < v for n, v in old.counters.items()):
        return True
    return any(n in cur.histograms and cur.histograms[n].count < h.count for n, h in old.histograms.items())


def counter_delta(old: float | None, cur: float | None, reset: bool) -> float | None:
    if cur is None:
        return None
    if reset or (old is not None and cur < old):
        return cur  # counted from zero since the restart
    if old is None:
        return None  # no baseline yet
    return cur - old


@dataclass(frozen=True)
class Interval:
    """What happened between two consecutive scrapes."""

    dt_s: float
    reset: bool
    decode_tps: float | None
    prefill_tps: float | None
    generation_tokens: float | None
    prompt_tokens: float | None
    active: bool
    spec_acceptance: float | None  # accepted / drafted tokens in this interval


def interval(old: Scrape, cur: Scrape) -> Interval:
    dt = cur.at - old.at
    reset = is_reset(old, cur)

    def delta(name: str) -> float | None:
        return counter_delta(old.counters.get(name), cur.counters.get(name), reset)

    gen, prompt = delta(F.GENERATION_TOKENS), delta(F.PROMPT_TOKENS)
    running = max(old.gauges.get(F.RUNNING, 0.0), cur.gauges.get(F.RUNNING, 0.0))
    active = running > 0 or (gen or 0) > PROBE_TOKENS or (prompt or 0) > PROBE_TOKENS
    drafted, accepted = delta(F.SPEC_DRAFT_TOKENS), delta(F.SPEC_ACCEPTED_TOKENS)
    return Interval(
        dt_s=dt, reset=reset,
        decode_tps=gen / dt if gen is not None and dt > 0 else None,
        prefill_tps=prompt / dt if prompt is not None and dt > 0 else None,
        generation_tokens=gen, prompt_tokens=prompt, active=active,
        spec_acceptance=(SpecDecode(0.0, drafted, accepted).acceptance_rate
                         if drafted is not None and accepted is not None else None),
    )


# ------------------------------------------------------------------------- histograms

def histogram_delta(old: Histogram | None, cur: Histogram, reset: bool) -> Histogram:
    """Observations between two scrapes (all of `cur` after a reset)."""
    if old is None or reset or cur.count < old.count:
        return cur
    before = dict(old.buckets)
    return Histogram(cur.count - old.count, cur.sum - old.sum,
                     tuple((le, max(0.0, c - before.get(le, 0.0))) for le, c in cur.buckets))


def quantile(q: float, h: Histogram) -> float | None:
    """Prometheus' histogram_quantile: linear interpolation inside the bucket holding rank q."""
    if h.count <= 0 or not h.buckets:
        return None
    total = h.buckets[-1][1]
    if total <= 0:
        return None
    rank = q * total
    lower_le, lower_count = 0.0, 0.0
    for le, count in h.buckets:
        if count >= rank:
            if le == float("inf"):
                return lower_le  # beyond the last finite bound: the best known is that bound
            if count == lower_count:
                return le
            return lower_le + (le - lower_le) * (rank - lower_count) / (count - lower_count)
        lower_le, lower_count = le, count
    return lower_le


def latency(old: Scrape | None, cur: Scrape, name: str) -> dict:
    """Mean, p50 and p95 over the window from `old` to `cur`, and the mean since vLLM started."""
    h = cur.histograms.get(name)
    out = {"window_mean": None, "p50": None, "p95": None, "lifetime_mean": None}
    if h is None:
        return out
    if h.count > 0:
        out["lifetime_mean"] = h.sum / h.count
    reset = old is not None and is_reset(old, cur)
    w = histogram_delta(old.histograms.get(name) if old is not None else None, h, reset)
    if w.count > 0:
        out["window_mean"] = max(0.0, w.sum) / w.count
        if w.count == 1:  # one observation: it is every quantile, exactly (buckets can be coarse)
            out["p50"] = out["p95"] = out["window_mean"]
        else:
            out["p50"], out["p95"] = quantile(0.5, w), quantile(0.95, w)
    return out


def spec_decode(cur: Scrape) -> dict | None:
    """Lifetime acceptance figures, or None when vLLM runs without speculative decoding."""
    s = spec_decode_of(cur)
    if s is None:
        return None
    return {"drafts": s.drafts, "draft_tokens": s.draft_tokens, "accepted_tokens": s.accepted_tokens,
            "acceptance_rate": s.acceptance_rate, "mean_acceptance_length": s.mean_acceptance_length}