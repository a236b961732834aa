"""Two scrapes -> rates and latency figures (pure).

A counter that went down, or a new `process_start_time_seconds`, means vLLM restarted: its
counters count again from zero, so the delta over that interval is the new value itself (as
Prometheus' rate() does). A rate is therefore never negative.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dspark.engine import facts as F
from dspark.engine.metrics import Histogram, Scrape, SpecDecode, spec_decode_of

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


@dataclass(frozen=True)
class QuantileRange:
    """What a histogram says about one quantile of its observations.

    vLLM's buckets are coarse (its first end-to-end bucket is 0-300 ms), so interpolating inside
    one says little: twelve 22 ms liveness probes came out as a 150 ms median beside a 22.1 ms
    mean. The exact sum narrows the bucket: at least n-k+1 observations are >= the k-th
    smallest, so it is at most (sum - the least the others can add) / (n-k+1); likewise from
    below. `low`..`high` holds the observations' own percentile (numpy's method, linear between
    the two closest ranks); `bucket` spans vLLM's bucket(s) holding those ranks (upper bound None
    for +Inf)."""

    low: float
    high: float | None
    bucket: tuple[float, float | None]


def _buckets(h: Histogram) -> list[tuple[float, float, int]]:
    """(lower bound, upper bound, observations) per bucket; latencies are never negative."""
    out, lower, below = [], 0.0, 0
    for le, cum in h.buckets:
        n = int(round(cum))
        out.append((lower, le, max(0, n - below)))
        lower, below = le, max(below, n)
    return out


def _weight(buckets: list[tuple[float, float, int]], side: int) -> float:
    """The sum of the observations were each at its bucket's lower (side 0) or upper (1) bound."""
    return sum(bound[side] * c for *bound, c in buckets if c)


def _order_statistic(k: int, buckets: list[tuple[float, float, int]], total: float | None) -> tuple[float, float, int]:
    """Bounds on the k-th smallest observation (1-based) and the index of its bucket; `total`
    (the exact sum) narrows them, or is None when it does not fit the buckets."""
    seen = 0
    for j, (a, b, c) in enumerate(buckets):  # noqa: B007 (read after the loop: the bucket it stopped at)
        if seen + c >= k:
            break
        seen += c
    low, high = a, b
    if total is not None:
        above = seen + c - k  # observations after the k-th in its own bucket
        # the others at their bucket's top: the k-th and those before it in its bucket share the rest
        others_max = _weight(buckets[:j], 1) + (above * b if above else 0.0) + _weight(buckets[j + 1:], 1)
        if others_max != float("inf"):
            low = max(low, (total - others_max) / (k - seen))
        # the others at their bucket's bottom: the k-th and those after it in its bucket share the rest
        others_min = _weight(buckets[:j], 0) + (k - 1 - seen) * a + _weight(buckets[j + 1:], 0)
        high = min(high, (total - others_min) / (above + 1))
    return low, max(low, high), j


def quantile_range(q: float, h: Histogram) -> QuantileRange | None:
    """Where the q-quantile of the observations in `h` provably lies (None for no observations)."""
    buckets = _buckets(h)
    n = sum(c for _, _, c in buckets)
    if n <= 0:
        return None
    total: float | None
    total = max(0.0, h.sum)
    least, most = _weight(buckets, 0), _weight(buckets, 1)
    if not least - 1e-9 <= total <= most + 1e-9:  # a sum that does not fit its buckets narrows nothing
        total = None
    pos = (n - 1) * q  # numpy's default: linear between the ranks floor(pos) and floor(pos)+1
    k1 = int(pos) + 1
    low, _, j1 = _order_statistic(k1, buckets, total)
    _, high, j2 = _order_statistic(min(k1 + 1, n) if pos > int(pos) else k1, buckets, total)
    b, inf = buckets[j2][1], float("inf")
    return QuantileRange(low, None if high == inf else high, (buckets[j1][0], None if b == inf else b))


def _estimate(q: float, h: Histogram, r: QuantileRange) -> float:
    """Prometheus' interpolation, kept inside the proven range."""
    est = quantile(q, h)
    est = r.low if est is None else max(r.low, est)
    return est if r.high is None else min(r.high, est)


def latency(old: Scrape | None, cur: Scrape, name: str) -> dict:
    """Mean, p50 and p95 over the window from `old` to `cur`, and the mean since vLLM started.

    The mean is exact (sum / count); a percentile is an estimate from vLLM's buckets, with the
    range it provably lies in (`p50_range`) and its bucket (`p50_bucket`). The median is never
    put above the mean unless its whole range is: where the range allows both, the mean is the
    estimate (latencies skew right: their median lies at or below their mean)."""
    h = cur.histograms.get(name)
    out: dict[str, Any] = {"window_mean": None, "p50": None, "p95": None, "lifetime_mean": None, "count": 0,
                           "p50_range": None, "p95_range": None, "p50_bucket": None, "p95_bucket": None}
    if h is None:
        return out
    if h.count > 0:
        out["lifetime_mean"] = h.sum / h.count
    reset = old is not None and is_reset(old, cur)
    w = histogram_delta(old.histograms.get(name) if old is not None else None, h, reset)
    out["count"] = int(round(w.count))
    if w.count <= 0:
        return out
    mean = out["window_mean"] = max(0.0, w.sum) / w.count
    previous = 0.0
    for q, key in ((0.5, "p50"), (0.95, "p95")):
        r = quantile_range(q, w)
        if r is None:
            continue
        est = _estimate(q, w, r)
        if key == "p50" and est > mean >= r.low:
            est = mean
        est = max(est, previous)  # p95 >= p50 (both ranges allow it: p95's reaches at least p50's)
        previous = est
        out[key], out[key + "_range"], out[key + "_bucket"] = est, [r.low, r.high], list(r.bucket)
    return out


def spec_decode(cur: Scrape) -> dict | None:
    """Lifetime acceptance figures, or None when vLLM runs without speculative decoding."""
    s = spec_decode_of(cur)
    if s is None:
        return None
    return {"drafts": s.drafts, "draft_tokens": s.draft_tokens, "accepted_tokens": s.accepted_tokens,
            "acceptance_rate": s.acceptance_rate, "mean_acceptance_length": s.mean_acceptance_length}

# ------------------------------------------------------------------------- finished requests

_FINISHED_SAMPLE = F.REQUEST_SUCCESS + "_total"


def finished_by_reason(text: str) -> dict[str, float] | None:
    """vllm:request_success_total summed by its finished_reason label (stop, length, abort, error,
    repetition on vLLM 0.28.0), over every engine; None when no sample carries that label (a vLLM
    that does not say why, or no such metric). Only that metric's lines are parsed; a malformed one
    reads as None (the strict parse of the rest already judged the page)."""
    from prometheus_client.parser import text_string_to_metric_families

    lines = [line for line in text.splitlines() if line.startswith(_FINISHED_SAMPLE + "{")]
    if not lines:
        return None
    out: dict[str, float] = {}
    try:
        for fam in text_string_to_metric_families("\n".join(lines) + "\n"):
            for s in fam.samples:
                reason = s.labels.get(F.FINISHED_REASON_LABEL)
                if s.name == _FINISHED_SAMPLE and reason and s.value >= 0 and s.value == s.value:
                    out[reason] = out.get(reason, 0.0) + s.value
    except Exception:  # noqa: BLE001 (the parser raises whatever a malformed line provokes)
        return None
    return out or None


def reason_delta(old: dict[str, float] | None, cur: dict[str, float] | None, reason: str,
                 reset: bool) -> float | None:
    """Requests that finished for `reason` between two scrapes (None where either does not say)."""
    if cur is None or (old is None and not reset):
        return None
    return counter_delta(old.get(reason, 0.0) if old is not None else None, cur.get(reason, 0.0), reset)
