"""vLLM's /metrics, scraped and parsed with prometheus_client, and the change between two
scrapes (a `Window`): what the server itself saw while a trial ran.

Metric names come from `dspark.vllm_facts` only. A metric this vLLM does not report gives
None, never 0, so a renamed metric shows up as "not reported" instead of a wrong figure.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from .. import vllm_facts as F

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


def parse(text: str, model: str | None = None) -> Snapshot:
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


def _busy(s: Snapshot) -> float | None:
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
        preemptions=c(F.NUM_PREEMPTIONS),
        spec_drafts=c(F.SPEC_DRAFTS),
        spec_draft_tokens=c(F.SPEC_DRAFT_TOKENS),
        spec_accepted_tokens=c(F.SPEC_ACCEPTED_TOKENS),
        busy_before=_busy(before),
        busy_after=_busy(after),
        seconds=after.taken_at - before.taken_at,
    )


@dataclass(frozen=True)
class SpecDecode:
    drafts: int
    draft_tokens: int
    accepted_tokens: int

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted / proposed draft tokens."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else None

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens produced per verification step: 1 + accepted / drafts."""
        return 1 + self.accepted_tokens / self.drafts if self.drafts else None


def spec_decode(w: Window) -> SpecDecode | None:
    """Speculative decoding counters of a window, when the server reports any drafts."""
    if not w.spec_drafts or w.spec_draft_tokens is None or w.spec_accepted_tokens is None:
        return None
    return SpecDecode(int(w.spec_drafts), int(w.spec_draft_tokens), int(w.spec_accepted_tokens))
