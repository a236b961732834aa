"""vLLM's /metrics, modelled once: every reader of vLLM's Prometheus text goes through here.

Parsed with prometheus_client's parser; the metric names come from dspark.engine.facts only.
Two views of one answer:
  `parse`          the few summed figures the dashboard and the liveness judge read (`Scrape`);
                   strict: anything that is not a serving vLLM's page is a MetricsError
  `parse_samples`  every sample, by name and labels (`Snapshot`), and the change between two
                   (`Window`): what the server itself saw while a bench trial ran. A metric this
                   vLLM does not report gives None, never 0 (a renamed metric shows as "not
                   reported", never as a wrong figure)
and the speculative-decoding figures both compute (`SpecDecode`).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from dspark.engine import facts as F

# ------------------------------------------------------------------ the summed view (`parse`)
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


# ------------------------------------------------------------------ every sample (`parse_samples`)
# Prometheus text conventions (not vLLM's): counter and histogram sample suffixes.
TOTAL = "_total"
SUM = "_sum"
COUNT = "_count"


@dataclass(frozen=True)
class Snapshot:
    """Every sample of one scrape: (sample name, sorted labels) -> value."""

    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float]
    model: str | None = None
    taken_at: float = field(default_factory=time.time)

    def value(self, name: str, **labels: str) -> float | None:
        """Sum of the samples called `name` whose labels include `labels` (and, when the
        snapshot is for one model, that model's); None when there is no such sample."""
        want = dict(labels)
        found = False
        total = 0.0
        for (sname, slabels), v in self.samples.items():
            if sname != name:
                continue
            lab = dict(slabels)
            if self.model is not None and F.MODEL_LABEL in lab and lab[F.MODEL_LABEL] != self.model:
                continue
            if any(lab.get(k) != val for k, val in want.items()):
                continue
            found = True
            total += v
        return total if found else None

    def counter(self, family: str, **labels: str) -> float | None:
        return self.value(family + TOTAL, **labels)

    def hist_sum(self, family: str) -> float | None:
        return self.value(family + SUM)

    def hist_count(self, family: str) -> float | None:
        return self.value(family + COUNT)

    def gauge(self, family: str) -> float | None:
        return self.value(family)

    def info(self, family: str) -> dict[str, str]:
        """The labels of an info-style gauge (value 1), e.g. the cache settings."""
        for (sname, slabels), _ in self.samples.items():
            if sname == family:
                lab = dict(slabels)
                if self.model is None or lab.get(F.MODEL_LABEL, self.model) == self.model:
                    return lab
        return {}


def parse_samples(text: str, model: str | None = None) -> Snapshot:
    """Every sample of one /metrics answer (bench: what the server saw during a trial)."""
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = (s.name, tuple(sorted(s.labels.items())))
            samples[key] = samples.get(key, 0.0) + float(s.value)
    return Snapshot(samples=samples, model=model)


def _d(before: float | None, after: float | None) -> float | None:
    if before is None or after is None:
        return None
    return after - before


@dataclass(frozen=True)
class Window:
    """Counter and histogram changes between two scrapes; None = not reported."""

    requests_finished: float | None       # request_success, every finished_reason
    prompt_tokens: float | None           # prompt tokens scheduled (cached ones included)
    generation_tokens: float | None
    prefill_requests: float | None        # request_prefill_time_seconds _count
    prefill_time_s: float | None          # request_prefill_time_seconds _sum
    computed_requests: float | None       # request_prefill_kv_computed_tokens _count
    computed_tokens: float | None         # request_prefill_kv_computed_tokens _sum
    prefix_cache_queries: float | None
    prefix_cache_hits: float | None       # tokens served from the prefix cache
    preemptions: float | None
    spec_drafts: float | None
    spec_draft_tokens: float | None
    spec_accepted_tokens: float | None
    busy_before: float | None             # running + waiting at the first scrape
    busy_after: float | None              # running + waiting at the second scrape
    seconds: float                        # between the scrapes (client clock)


def busy(s: Snapshot) -> float | None:
    """Requests running plus waiting at one scrape; None if the server reports neither."""
    run, wait = s.gauge(F.RUNNING), s.gauge(F.WAITING)
    if run is None and wait is None:
        return None
    return (run or 0.0) + (wait or 0.0)


def window(before: Snapshot, after: Snapshot) -> Window:
    def c(family: str) -> float | None:
        return _d(before.counter(family), after.counter(family))

    return Window(
        requests_finished=c(F.REQUEST_SUCCESS),
        prompt_tokens=c(F.PROMPT_TOKENS),
        generation_tokens=c(F.GENERATION_TOKENS),
        prefill_requests=_d(before.hist_count(F.PREFILL_TIME), after.hist_count(F.PREFILL_TIME)),
        prefill_time_s=_d(before.hist_sum(F.PREFILL_TIME), after.hist_sum(F.PREFILL_TIME)),
        computed_requests=_d(before.hist_count(F.PREFILL_KV_COMPUTED), after.hist_count(F.PREFILL_KV_COMPUTED)),
        computed_tokens=_d(before.hist_sum(F.PREFILL_KV_COMPUTED), after.hist_sum(F.PREFILL_KV_COMPUTED)),
        prefix_cache_queries=c(F.PREFIX_CACHE_QUERIES),
        prefix_cache_hits=c(F.PREFIX_CACHE_HITS),
        preemptions=c(F.PREEMPTIONS),
        spec_drafts=c(F.SPEC_DRAFTS),
        spec_draft_tokens=c(F.SPEC_DRAFT_TOKENS),
        spec_accepted_tokens=c(F.SPEC_ACCEPTED_TOKENS),
        busy_before=busy(before),
        busy_after=busy(after),
        seconds=after.taken_at - before.taken_at,
    )


# ------------------------------------------------------------------ speculative decoding
@dataclass(frozen=True)
class SpecDecode:
    """Speculative decoding counters (over a window, an interval or the server's lifetime)."""

    drafts: float
    draft_tokens: float
    accepted_tokens: float

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted / proposed draft tokens."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens > 0 else None

    @property
    def mean_acceptance_length(self) -> float | None:
        """vLLM's own definition: the bonus token plus the accepted ones, per draft."""
        return 1 + self.accepted_tokens / self.drafts if self.drafts > 0 else None


def spec_decode(w: Window) -> SpecDecode | None:
    """Speculative decoding counters of a window, when the server reports any drafts."""
    if not w.spec_drafts or w.spec_draft_tokens is None or w.spec_accepted_tokens is None:
        return None
    return SpecDecode(int(w.spec_drafts), int(w.spec_draft_tokens), int(w.spec_accepted_tokens))


def spec_decode_of(s: Scrape) -> SpecDecode | None:
    """Lifetime counters from one scrape, or None when vLLM runs without speculative decoding."""
    drafted = s.counters.get(F.SPEC_DRAFT_TOKENS)
    if drafted is None:
        return None
    return SpecDecode(s.counters.get(F.SPEC_DRAFTS, 0.0), drafted, s.counters.get(F.SPEC_ACCEPTED_TOKENS, 0.0))
