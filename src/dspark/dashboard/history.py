"""The dashboard's history: one row per round (throughput, queue, KV cache, finished requests,
the latencies' percentile ranges), the newest `capacity` of them, served as columns for the
page's charts."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping

from dspark.dashboard import rates
from dspark.dashboard.agent_fields import rounded
from dspark.engine import facts as F

LATENCIES = (("ttft_s", F.TTFT), ("itl_s", F.ITL), ("e2e_s", F.E2E))
QUANTILE_KEYS = ("p50_low", "p50_high", "p95_low", "p95_high")
HISTORY_KEYS = ("t", "decode_tps", "prefill_tps", "running", "waiting", "kv_cache_usage",
                "requests_per_s", "errors", "aborts", "latency")


def quantiles(lat: dict | None) -> tuple:
    """(p50 low, p50 high, p95 low, p95 high) of one latency over the window, for the history;
    None where nothing finished in it (a high of None: unbounded)."""
    if not lat:
        return (None,) * 4
    p50, p95 = lat.get("p50_range") or (None, None), lat.get("p95_range") or (None, None)
    return (p50[0], p50[1], p95[0], p95[1])


class History:
    def __init__(self, capacity: int) -> None:
        self.rows: deque[tuple] = deque(maxlen=capacity)

    def record(self, iv: rates.Interval | None, gauges: Mapping[str, float], finished: dict, latency: dict) -> None:
        """This round's row: the interval's rates, the gauges, and the snapshot's "finished" and
        "latency" parts (empty when vLLM was not scraped)."""
        self.rows.append((round(time.time(), 3), rounded(iv.decode_tps if iv else None),
                          rounded(iv.prefill_tps if iv else None), gauges.get(F.RUNNING), gauges.get(F.WAITING),
                          rounded(gauges.get(F.KV_USAGE), 4), finished.get("per_s"), finished.get("errors_interval"),
                          finished.get("aborts_interval"),
                          {key: quantiles(latency.get(key)) for key, _ in LATENCIES}))

    def to_json(self) -> dict:
        """The snapshot's "history": one list per key, the latencies' by quantile."""
        cols = list(zip(*self.rows, strict=True)) if self.rows else [()] * len(HISTORY_KEYS)
        history: dict = {"capacity": self.rows.maxlen,
                         **{k: list(v) for k, v in zip(HISTORY_KEYS, cols, strict=True)}}
        history["latency"] = {key: {q: [p[key][i] for p in history["latency"]] for i, q in enumerate(QUANTILE_KEYS)}
                              for key, _ in LATENCIES}
        return history
