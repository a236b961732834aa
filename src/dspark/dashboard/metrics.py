"""vLLM's Prometheus text -> the few numbers the dashboard shows (pure).

Parsed with prometheus_client's parser; the metric names come from dspark.vllm_facts.
Values are summed over label sets (engines, finish reasons); the KV-cache usage is the mean
over engines.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from .. import vllm_facts as F

COUNTERS = (F.PROMPT_TOKENS, F.GENERATION_TOKENS, F.REQUEST_SUCCESS, F.PREEMPTIONS,
            F.SPEC_DRAFTS, F.SPEC_DRAFT_TOKENS, F.SPEC_ACCEPTED_TOKENS)
GAUGES = (F.RUNNING, F.WAITING, F.KV_USAGE)
HISTOGRAMS = (F.TTFT, F.ITL, F.E2E)
# Without these the answer is not vLLM's (or not a serving vLLM's) metrics page.
REQUIRED = (F.GENERATION_TOKENS, F.PROMPT_TOKENS, F.RUNNING)
WANTED = COUNTERS + GAUGES + HISTOGRAMS + (F.PROCESS_START_TIME,)


class MetricsError(Exception):
    """The text is not usable vLLM metrics; the message says why (shown as 'unavailable')."""


@dataclass(frozen=True)
class Histogram:
    count: float
    sum: float
    # (upper bound, cumulative count), ascending; the last bound is +Inf
    buckets: tuple[tuple[float, float], ...]


@dataclass(frozen=True)
class Scrape:
    at: float  # time.monotonic() of the scrape
    counters: dict[str, float] = field(default_factory=dict)
    gauges: dict[str, float] = field(default_factory=dict)
    histograms: dict[str, Histogram] = field(default_factory=dict)
    process_start: float | None = None

    def counter(self, name: str) -> float | None:
        return self.counters.get(name)


def relevant_lines(text: str) -> str:
    """Only the lines of the families used here (samples, HELP and TYPE), for the parser.

    vLLM's page has ~600 lines, most of them histograms the dashboard does not show; the
    parser costs ~8 ms a second for all of them, a few for these. The parser still reads
    every line kept, so a malformed one among them is still an error."""
    keep = []
    for line in text.splitlines():
        if line.startswith("#"):
            parts = line.split(None, 3)
            if len(parts) >= 3 and parts[2].startswith(WANTED):
                keep.append(line)
        elif line.startswith(WANTED):
            keep.append(line)
    return "\n".join(keep) + "\n"


def parse(text: str, at: float) -> Scrape:
    """Parse one /metrics answer. Raises MetricsError for anything that is not vLLM's metrics."""
    text = relevant_lines(text)
    counters: dict[str, float] = {}
    gauge_values: dict[str, list[float]] = {}
    hist: dict[str, dict] = {}
    process_start = None
    try:
        for fam in text_string_to_metric_families(text):
            name = fam.name
            if name == F.PROCESS_START_TIME:
                process_start = next((s.value for s in fam.samples), None)
            elif name in COUNTERS:
                counters[name] = sum(s.value for s in fam.samples if s.name == name + "_total")
            elif name in GAUGES:
                gauge_values[name] = [s.value for s in fam.samples if s.name == name]
            elif name in HISTOGRAMS:
                h = hist.setdefault(name, {"count": 0.0, "sum": 0.0, "le": {}})
                for s in fam.samples:
                    if s.name == name + "_count":
                        h["count"] += s.value
                    elif s.name == name + "_sum":
                        h["sum"] += s.value
                    elif s.name == name + "_bucket":
                        le = float(s.labels["le"])
                        h["le"][le] = h["le"].get(le, 0.0) + s.value
    # The parser is a generator that raises whatever the malformed line provokes (ValueError,
    # IndexError, KeyError, TypeError ...): every one means "not usable", never a crash.
    except Exception as e:  # noqa: BLE001
        raise MetricsError(f"malformed metrics text: {type(e).__name__}: {e}") from None
    missing = [n for n in REQUIRED if n not in counters and n not in gauge_values]
    if missing:
        raise MetricsError("no vLLM metrics in the answer (missing " + ", ".join(missing) + ")")
    values = [v for vs in gauge_values.values() for v in vs] + list(counters.values())
    if any(math.isnan(v) or v < 0 for v in values):
        raise MetricsError("metrics text holds negative or NaN counts")
    gauges = {n: sum(vs) for n, vs in gauge_values.items() if vs}
    if gauge_values.get(F.KV_USAGE):
        gauges[F.KV_USAGE] = sum(gauge_values[F.KV_USAGE]) / len(gauge_values[F.KV_USAGE])
    histograms = {n: Histogram(h["count"], h["sum"], tuple(sorted(h["le"].items()))) for n, h in hist.items()}
    return Scrape(at=at, counters=counters, gauges=gauges, histograms=histograms, process_start=process_start)
