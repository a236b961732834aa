"""Latency figures that cannot contradict each other.

The dashboard sees no single request: its p50 and p95 come from vLLM's histogram buckets, and
those are coarse (the first end-to-end bucket is 0-300 ms). Idle, what finishes is the head's
1-token liveness probe, about 22 ms each, and plain bucket interpolation (Prometheus'
histogram_quantile) put the median at 150 ms and the p95 at 285 ms beside a mean of 22.1 ms.

The histograms here are real ones: prometheus_client's Histogram with the bucket bounds of the
installed vLLM's metrics definitions (vllm/v1/metrics/loggers.py, read from its source), its
exposition text parsed by the dashboard's own parser.
"""

from __future__ import annotations

import ast
import importlib.util
import random
from functools import cache
from pathlib import Path

import pytest

from dspark.bench import stats
from dspark.dashboard import rates
from dspark.engine import facts as F
from dspark.engine.metrics import parse

HISTOGRAMS = (F.TTFT, F.ITL, F.E2E)


@cache
def vllm_buckets() -> dict[str, list[float]]:
    """Each histogram's bucket bounds as the installed vLLM defines them (from its source: importing
    vLLM costs seconds, and its loggers only build the histograms for a running engine)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        pytest.skip("vLLM is not installed in this environment")
    tree = ast.parse((Path(spec.origin).parent / "v1" / "metrics" / "loggers.py").read_text())
    lists = {t.id: n.value for n in ast.walk(tree) if isinstance(n, ast.Assign)
             for t in n.targets if isinstance(t, ast.Name) and isinstance(n.value, ast.List)}
    out = {}
    for call in (n for n in ast.walk(tree) if isinstance(n, ast.Call)):
        kw = {k.arg: k.value for k in call.keywords}
        name = kw.get("name")
        if isinstance(name, ast.Constant) and name.value in HISTOGRAMS and "buckets" in kw:
            b = kw["buckets"]
            out[name.value] = [float(v) for v in ast.literal_eval(lists[b.id] if isinstance(b, ast.Name) else b)]
    assert set(out) == set(HISTOGRAMS), out.keys()
    return out


def metrics_text(observations: dict[str, list[float]]) -> str:
    """vLLM's /metrics text with these histograms (and the counters the parser requires)."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

    reg = CollectorRegistry()
    Counter(F.GENERATION_TOKENS, "generated", registry=reg).inc(sum(len(v) for v in observations.values()))
    Counter(F.PROMPT_TOKENS, "prompt", registry=reg)
    Gauge(F.RUNNING, "running", registry=reg)
    for name in HISTOGRAMS:
        h = Histogram(name, name, buckets=vllm_buckets()[name], registry=reg)
        for v in observations.get(name, []):
            h.observe(v)
    return generate_latest(reg).decode()


def scrape(observations: dict[str, list[float]], at: float):
    return parse(metrics_text(observations), at)


def window(before: list[float], during: list[float], name: str = F.E2E) -> dict:
    """rates.latency over a window in which `during` finished, after `before` had."""
    return rates.latency(scrape({name: before}, 0.0), scrape({name: before + during}, 60.0), name)


# Twelve liveness probes in a 60 s window (one every 5 s), end-to-end 19.6-24.6 ms, mean 22.1 ms,
# after one real request of 2.84 s earlier in vLLM's life.
IDLE_PROBES = [0.0196, 0.0201, 0.0208, 0.0212, 0.0217, 0.0219, 0.0223, 0.0226, 0.0230, 0.0234, 0.0240, 0.0246]


def test_vllm_buckets_are_read_from_the_installed_vllm():
    b = vllm_buckets()
    assert b[F.E2E][:3] == [0.3, 0.5, 0.8]  # vLLM 0.28.0's request_latency_buckets
    assert b[F.TTFT][0] == 0.001 and b[F.ITL][0] == 0.01
    assert all(x < y for v in b.values() for x, y in zip(v, v[1:], strict=False))


def test_idle_probes_median_never_above_their_mean():
    lat = window([2.84], IDLE_PROBES)
    mean = sum(IDLE_PROBES) / len(IDLE_PROBES)
    assert lat["window_mean"] == pytest.approx(mean, abs=1e-6) and round(mean, 4) == 0.0221
    assert lat["count"] == 12
    # all twelve fall in vLLM's first bucket, 0-300 ms: that is where the 150 ms and 285 ms came from
    assert lat["p50_bucket"] == lat["p95_bucket"] == [0.0, 0.3]
    assert lat["p50"] <= lat["window_mean"]
    # The range the buckets and the exact sum allow: at least half the probes are >= the median,
    # so it is at most twice the mean, not 150 ms; and it holds the true median.
    low, high = lat["p50_range"]
    assert low <= stats.percentile(IDLE_PROBES, 50) <= high <= 2 * mean + 1e-9
    low95, high95 = lat["p95_range"]
    assert low95 <= stats.percentile(IDLE_PROBES, 95) <= high95 <= 0.3
    assert lat["p50"] <= lat["p95"] <= high95


def test_median_proven_above_the_mean_is_marked_by_its_range():
    """A p50 above the mean is shown only when the buckets prove it: its whole range lies above
    the mean (a few very fast requests pull the mean down)."""
    during = [0.001] * 4 + [2.4] * 6  # six in vLLM's 2.0-2.5 s bucket, four in the first
    lat = window([], during)
    low, high = lat["p50_range"]
    assert lat["p50_bucket"] == [2.0, 2.5]
    assert low > lat["window_mean"] and low <= lat["p50"] <= high
    assert low <= stats.percentile(during, 50) <= high


def test_one_request_is_every_quantile_exactly():
    lat = window([0.5], [0.0421], F.TTFT)
    assert lat["p50"] == lat["p95"] == lat["window_mean"] == pytest.approx(0.0421)
    assert lat["p50_range"] == [pytest.approx(0.0421)] * 2


@pytest.mark.parametrize("name", HISTOGRAMS)
def test_ranges_hold_the_true_quantiles(name):
    """On 300 seeded random windows per histogram (1-200 requests; lognormal, bimodal and
    constant latencies): the range always holds the requests' own percentile (numpy's method),
    the estimate lies in the range, the median never exceeds the mean unless its range does,
    and p50 <= p95."""
    rng = random.Random(f"issue-24-{name}")
    bounds = vllm_buckets()[name]
    for trial in range(300):
        n = rng.choice([2, 3, 5, 12, 40, 200])
        centre = rng.choice(bounds[:12]) * rng.uniform(0.3, 1.5)
        shape = trial % 3
        if shape == 0:
            during = [centre * rng.lognormvariate(0, 0.6) for _ in range(n)]
        elif shape == 1:
            during = [centre * (0.05 if rng.random() < 0.3 else 1.0) * rng.uniform(0.9, 1.1) for _ in range(n)]
        else:
            during = [centre] * n
        lat = window([rng.uniform(0.001, 3.0)], during, name)
        mean = lat["window_mean"]
        for q, key in ((50, "p50"), (95, "p95")):
            low, high = lat[key + "_range"]
            true = stats.percentile(during, q)
            assert low - 1e-9 <= true <= high + 1e-9, (trial, key, true, lat)
            assert low - 1e-9 <= lat[key] <= high + 1e-9, (trial, key, lat)
            b_low, b_high = lat[key + "_bucket"]
            assert b_low <= low and (b_high is None or high <= b_high), (trial, key, lat)
        assert lat["p50"] <= mean + 1e-9 or lat["p50_range"][0] > mean, (trial, lat)
        assert lat["p50"] <= lat["p95"], (trial, lat)


def test_no_window_no_figures():
    lat = window([0.3, 0.4], [])
    assert lat["count"] == 0
    assert lat["p50"] is lat["p95"] is lat["p50_range"] is lat["p95_bucket"] is None
