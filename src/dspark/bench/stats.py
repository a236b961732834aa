"""Small statistics: medians and percentiles with the same method as numpy's default
(linear interpolation between closest ranks), which `vllm bench serve` reports."""

from __future__ import annotations

import math
from collections.abc import Sequence


def percentile(values: Sequence[float | None], q: float) -> float | None:
    """The q-th percentile (0..100) of `values` (None values left out); None for no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be within 0..100, not {q}")
    xs = sorted(v for v in values if v is not None and not math.isnan(v))
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def median(values: Sequence[float | None]) -> float | None:
    return percentile(values, 50)


def mean(values: Sequence[float | None]) -> float | None:
    xs = [v for v in values if v is not None]
    return sum(xs) / len(xs) if xs else None


def rate(amount: float, seconds: float | None) -> float | None:
    """amount / seconds, or None when the time is unknown or not positive."""
    if seconds is None or seconds <= 0:
        return None
    return amount / seconds
