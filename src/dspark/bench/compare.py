"""Compare two reports of the same workload: a Markdown table of before, after and gain, each
figure with its standard error and each gain with the noise band it is judged against.

Reports are comparable only when they sent identical prompts (same prompt-set SHA-256)
with identical parameters; anything else is refused, because a difference in the input
would show up as a difference in speed.

The noise: every figure's standard error comes from the report itself (the decode level's
aggregate_tok_s_se; a median or percentile's from the order statistics of the trials or
requests it was taken over; the inter-token latency's from the spread of the requests' own
percentiles, since the gaps of one stream are not independent). A difference counts as
within the noise when it is at most twice the standard error of the difference,
sqrt(se_a^2 + se_b^2): the band, shown as a gain, is that bound over the figure the gain
divides by. Where either side has no standard error (one trial, a counter), it says so.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from dspark.bench import stats
from dspark.bench.report import DecodeLevel, DecodeRequest, PrefillSummary, PrefillTrial, Report, fmt, md

# Parameters that shape the workload; a difference in any of them makes figures incomparable.
WORKLOAD_PARAMS = ("lengths", "trials", "seed", "max_tokens", "concurrency", "output_len", "input_len",
                   "rounds", "temperature", "ignore_eos")


class CompareRefused(Exception):
    """The two reports did not measure the same workload."""


S = TypeVar("S")  # the summary type a figure reads (PrefillSummary or DecodeLevel)


def percentile_se(values: list[float | None], q: float) -> float | None:
    """Standard error of the q-th percentile (0..100) of `values`, from their order statistics:
    the percentile's rank moves by sqrt(n p (1 - p)) ranks for one standard error (the binomial
    count of values below it), so half the distance between the values at p -/+ sqrt(p (1 - p) / n).
    None below two values."""
    xs = [v for v in values if v is not None and math.isfinite(v)]
    if len(xs) < 2:
        return None
    p = q / 100
    h = math.sqrt(p * (1 - p) / len(xs)) or 1 / len(xs)  # p = 0 or 1: the next rank
    lo, hi = stats.percentile(xs, max(0.0, p - h) * 100), stats.percentile(xs, min(1.0, p + h) * 100)
    assert lo is not None and hi is not None  # xs is not empty
    return (hi - lo) / 2


def mean_se(values: list[float | None]) -> float | None:
    """The standard error of the mean of `values`: their standard deviation over sqrt(n)."""
    xs = [v for v in values if v is not None and math.isfinite(v)]
    if len(xs) < 2:
        return None
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1) / len(xs))


def _clean(trials: list[PrefillTrial]) -> list[PrefillTrial]:
    return [t for t in trials if not t.prefix_cache_hit_tokens]  # prefill.summarize's medians


def _itl_se(reqs: list[DecodeRequest], q: float) -> float | None:
    """The pooled ITL percentile's standard error with each request one sample (the gaps of one
    stream move together): the spread of the requests' own percentiles over sqrt(requests)."""
    return mean_se([stats.percentile(r.itl_s, q) for r in reqs if r.itl_s])


def _aggregate_se(s: DecodeLevel, reqs: list[DecodeRequest]) -> float | None:
    if s.aggregate_tok_s_se is not None:
        return s.aggregate_tok_s_se
    # a report written before the field: the same formula, from its requests
    from dspark.bench.decode import aggregate_se

    return aggregate_se(s.aggregate_tok_s, [r.e2e_s for r in reqs])


@dataclass(frozen=True)
class Figure(Generic[S]):
    name: str
    unit: str
    higher_is_better: bool
    get: Callable[[S], float | None]
    scale: float = 1.0
    # Its standard error, from the summary and the measured trials (prefill) or requests (decode)
    # it was taken over; None where the report holds nothing to tell it by.
    se: Callable[[S, list[Any]], float | None] = lambda s, trials: None


PREFILL_FIGURES: tuple[Figure[PrefillSummary], ...] = (
    Figure("TTFT median", "ms", False, lambda s: s.ttft_s, 1000.0,
           lambda s, ts: percentile_se([t.ttft_s for t in _clean(ts)], 50)),
    Figure("client input tok/s", "tok/s", True, lambda s: s.client_input_tok_s, 1.0,
           lambda s, ts: percentile_se([t.client_input_tok_s for t in _clean(ts)], 50)),
    Figure("server prefill tok/s", "tok/s", True, lambda s: s.server_prefill_tok_s, 1.0,
           lambda s, ts: percentile_se([t.server_prefill_tok_s for t in ts if t.server_valid], 50)),
)
DECODE_FIGURES: tuple[Figure[DecodeLevel], ...] = (
    Figure("aggregate tok/s", "tok/s", True, lambda s: s.aggregate_tok_s, 1.0, _aggregate_se),
    Figure("per-stream decode tok/s (median)", "tok/s", True, lambda s: s.decode_tok_s_median, 1.0,
           lambda s, rs: percentile_se([r.decode_tok_s for r in rs], 50)),
    Figure("TTFT p50", "ms", False, lambda s: s.ttft_s_p50, 1000.0,
           lambda s, rs: percentile_se([r.ttft_s for r in rs], 50)),
    Figure("ITL p50", "ms", False, lambda s: s.itl_s_p50, 1000.0, lambda s, rs: _itl_se(rs, 50)),
    Figure("ITL p99", "ms", False, lambda s: s.itl_s_p99, 1000.0, lambda s, rs: _itl_se(rs, 99)),
    Figure("spec acceptance rate", "%", True, lambda s: s.spec_acceptance_rate, 100.0),
)
NOISE_SE = 2.0  # a difference within this many standard errors of the difference is noise


# The options that set each kind's workload, for the hint of a refusal.
WORKLOAD_OPTIONS = {"prefill": "--seed, --lengths, --trials",
                    "decode": "--seed, --concurrency, --input-len, --output-len, --rounds"}


def check_comparable(a: Report, b: Report) -> None:
    if a.kind != b.kind:
        raise CompareRefused(f"cannot compare a {a.kind} report with a {b.kind} report")
    diff = [k for k in WORKLOAD_PARAMS if a.params.get(k) != b.params.get(k)]
    named = ", ".join(f"{k} {a.params.get(k)!r} vs {b.params.get(k)!r}" for k in diff)
    if a.prompt_set_sha256 != b.prompt_set_sha256:
        detail = ""
        for i, (x, y) in enumerate(zip(a.planned_prompts, b.planned_prompts, strict=False)):
            if x != y:
                detail = f"; first difference at planned prompt {i}: {x[:12]}... vs {y[:12]}..."
                break
        else:
            if len(a.planned_prompts) != len(b.planned_prompts):
                detail = f"; {len(a.planned_prompts)} vs {len(b.planned_prompts)} planned prompts"
        because = f"; the parameters that differ: {named}" if diff else ""
        raise CompareRefused("prompt fingerprints differ: the reports did not send identical prompts "
                             f"({a.prompt_set_sha256[:12]}... vs {b.prompt_set_sha256[:12]}...){because}{detail}; "
                             f"rerun one with the other's parameters ({WORKLOAD_OPTIONS.get(a.kind, '--seed')})")
    if diff:
        raise CompareRefused("workload parameters differ: " + named)


def gain(before: float | None, after: float | None, higher_is_better: bool) -> float | None:
    """Relative improvement: positive is better whichever way the figure points."""
    if before is None or after is None or not math.isfinite(before) or not math.isfinite(after) \
            or before <= 0 or after <= 0:
        return None
    return after / before - 1 if higher_is_better else before / after - 1


@dataclass(frozen=True)
class Judged:
    """One figure's gain and how it stands against the noise."""

    gain: float | None
    band: float | None  # the largest gain (either way) within the noise; None: unknown
    verdict: str  # "within noise", "better", "worse", "noise unknown" or "n/a"


def judge(before: float | None, se_before: float | None, after: float | None, se_after: float | None,
          higher_is_better: bool) -> Judged:
    """The gain, and whether the difference is within NOISE_SE standard errors of the difference."""
    g = gain(before, after, higher_is_better)
    if g is None:
        return Judged(None, None, "n/a")
    assert before is not None and after is not None  # gain() refused the rest
    if se_before is None or se_after is None:
        return Judged(g, None, "noise unknown")
    band = NOISE_SE * math.hypot(se_before, se_after) / (before if higher_is_better else after)
    if abs(g) <= band:
        return Judged(g, band, "within noise")
    return Judged(g, band, "better" if g > 0 else "worse")


def _g(v: float | None) -> str:
    return "n/a" if v is None else f"{v:+.1%}"


def _digits(se: float | None) -> int:
    """Decimals that show a standard error to two significant digits (1 to 4)."""
    if se is None or not math.isfinite(se) or se <= 0:
        return 1
    return max(1, min(4, 1 - math.floor(math.log10(se))))


def _with_se(v: float | None, se: float | None, scale: float) -> str:
    if v is None or not math.isfinite(v):
        return "n/a"
    if se is None:
        return fmt(v * scale)
    d = _digits(se * scale)
    return f"{fmt(v * scale, d)} ± {fmt(se * scale, d)}"


def _measured(report: Report, key: str, k: int) -> list[Any]:
    """The measured trials (prefill) or requests (decode) a level's figures were taken over."""
    return [t for t in report.trials if getattr(t, key) == k and t.role == "trial"]


def table(a: Report, b: Report) -> str:
    """The comparison as Markdown; raises CompareRefused for different workloads."""
    check_comparable(a, b)
    figures: tuple[Figure[Any], ...]  # the summaries are PrefillSummary or DecodeLevel, as the kind says
    if a.kind == "prefill":
        key, what, figures = "length", "input tokens", PREFILL_FIGURES
    else:
        key, what, figures = "concurrency", "concurrency", DECODE_FIGURES
    sa = {getattr(s, key): s for s in a.summary}
    sb = {getattr(s, key): s for s in b.summary}
    keys = [k for k in sa if k in sb]
    la, lb = md(a.label), md(b.label)
    if la == lb:
        la, lb = f"{la} (A)", f"{lb} (B)"
    lines = [
        f"# dspark bench compare ({a.kind}): {la} -> {lb}",
        "",
        f"- before: {la}, vLLM {md(a.server.get('runtime_version'))}, started {md(a.started_at)}"
        + ("" if a.complete else " (INCOMPLETE)"),
        f"- after: {lb}, vLLM {md(b.server.get('runtime_version'))}, started {md(b.started_at)}"
        + ("" if b.complete else " (INCOMPLETE)"),
        f"- identical prompts: SHA-256 {md(a.prompt_set_sha256)}",
        "- gain: positive is better (throughput up, latency down)",
        f"- ± is one standard error, from each report's own {'trials' if a.kind == 'prefill' else 'requests'}; "
        f"noise: the largest gain within {NOISE_SE:g} standard errors of the difference, "
        "sqrt(se_before² + se_after²); a gain inside it is marked within noise",
        "",
        f"| {what} | figure | {la} | {lb} | gain | noise | verdict |",
        "|---:|---|---:|---:|---:|---:|---|",
    ]
    verdicts = []
    for k in keys:
        ta, tb = _measured(a, key, k), _measured(b, key, k)
        for f in figures:
            va, vb = f.get(sa[k]), f.get(sb[k])
            if va is None and vb is None:
                continue
            ea = None if va is None else f.se(sa[k], ta)
            eb = None if vb is None else f.se(sb[k], tb)
            j = judge(va, ea, vb, eb, f.higher_is_better)
            verdicts.append(j.verdict)
            band = "unknown" if j.band is None else f"±{j.band:.1%}"
            lines.append(f"| {k:,} | {f.name} ({f.unit}) | {_with_se(va, ea, f.scale)} | {_with_se(vb, eb, f.scale)} | "
                         f"{_g(j.gain)} | {band if j.gain is not None else 'n/a'} | {j.verdict} |")
    judged = [v for v in verdicts if v in ("within noise", "better", "worse")]
    if verdicts:
        beyond = [v for v in judged if v != "within noise"]
        lines += ["", f"{len(judged) - len(beyond)} of {len(judged)} differences with a known noise are within it"
                  + (f"; beyond it: {beyond.count('better')} better, {beyond.count('worse')} worse" if beyond else "")
                  + (f"; {verdicts.count('noise unknown')} without a standard error on both sides (a single "
                     "trial, or a server counter)" if "noise unknown" in verdicts else "") + "."]
    for label, summ in ((la, sa), (lb, sb)):
        hit = [k for k, s in summ.items() if getattr(s, "prefix_cache_hit_trials", 0)
               or getattr(s, "prefix_cache_hit_tokens", 0)]
        if hit:
            lines += ["", f"**{label} hit the prefix cache** at {', '.join(map(str, hit))} (n/a there): "
                      "the server had seen those prompts (a run with --shared-prefix-cache, or a server that ignores "
                      "vLLM's cache_salt); rerun without that flag, or restart the server before the run."]
    missing = sorted(set(sa) ^ set(sb))
    if missing:
        lines += ["", f"Only in one report (left out): {', '.join(map(str, missing))}"]
    return "\n".join(lines) + "\n"
