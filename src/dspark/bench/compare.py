"""Compare two reports of the same workload: a Markdown table of before, after and gain.

Reports are comparable only when they sent identical prompts (same prompt-set SHA-256)
with identical parameters; anything else is refused, because a difference in the input
would show up as a difference in speed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Generic, TypeVar

from .report import DecodeLevel, PrefillSummary, Report, fmt, md

# Parameters that shape the workload; a difference in any of them makes figures incomparable.
WORKLOAD_PARAMS = ("lengths", "trials", "seed", "max_tokens", "concurrency", "output_len", "input_len",
                   "rounds", "temperature", "ignore_eos")


class CompareRefused(Exception):
    """The two reports did not measure the same workload."""


S = TypeVar("S")  # the summary type a figure reads (PrefillSummary or DecodeLevel)


@dataclass(frozen=True)
class Figure(Generic[S]):
    name: str
    unit: str
    higher_is_better: bool
    get: Callable[[S], float | None]
    scale: float = 1.0


PREFILL_FIGURES: tuple[Figure[PrefillSummary], ...] = (
    Figure("TTFT median", "ms", False, lambda s: s.ttft_s, 1000.0),
    Figure("client input tok/s", "tok/s", True, lambda s: s.client_input_tok_s),
    Figure("server prefill tok/s", "tok/s", True, lambda s: s.server_prefill_tok_s),
)
DECODE_FIGURES: tuple[Figure[DecodeLevel], ...] = (
    Figure("aggregate tok/s", "tok/s", True, lambda s: s.aggregate_tok_s),
    Figure("per-stream decode tok/s (median)", "tok/s", True, lambda s: s.decode_tok_s_median),
    Figure("TTFT p50", "ms", False, lambda s: s.ttft_s_p50, 1000.0),
    Figure("ITL p50", "ms", False, lambda s: s.itl_s_p50, 1000.0),
    Figure("ITL p99", "ms", False, lambda s: s.itl_s_p99, 1000.0),
    Figure("spec acceptance rate", "%", True, lambda s: s.spec_acceptance_rate, 100.0),
)


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
        for i, (x, y) in enumerate(zip(a.planned_prompts, b.planned_prompts)):
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


def _g(v: float | None) -> str:
    return "n/a" if v is None else f"{v:+.1%}"


def _scaled(v: float | None, scale: float) -> float | None:
    return None if v is None else v * scale


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
        "",
        f"| {what} | figure | {la} | {lb} | gain |",
        "|---:|---|---:|---:|---:|",
    ]
    for k in keys:
        for f in figures:
            va, vb = f.get(sa[k]), f.get(sb[k])
            if va is None and vb is None:
                continue
            lines.append(f"| {k:,} | {f.name} ({f.unit}) | {fmt(_scaled(va, f.scale))} | {fmt(_scaled(vb, f.scale))} | "
                         f"{_g(gain(va, vb, f.higher_is_better))} |")
    for label, summ in ((la, sa), (lb, sb)):
        hit = [k for k, s in summ.items() if getattr(s, "prefix_cache_hit_trials", 0)
               or getattr(s, "prefix_cache_hit_tokens", 0)]
        if hit:
            lines += ["", f"**{label} hit the prefix cache** at {', '.join(map(str, hit))} (n/a there): "
                      "the server had seen those prompts (a run with --shared-prefix-cache, or a server that ignores "
                      "vLLM's cache_salt); rerun without that flag, or restart the server before the run."]
    missing = sorted((set(sa) ^ set(sb)))
    if missing:
        lines += ["", f"Only in one report (left out): {', '.join(map(str, missing))}"]
    return "\n".join(lines) + "\n"
