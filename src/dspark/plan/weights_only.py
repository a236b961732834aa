"""The plan of a model whose KV-cache layout dspark does not model (DeepSeek-V4.1-Flash): the
weights per rank, the runtime reserve, the memory left for the KV cache and whether the
weights and the reserve fit; no KV token figures, since they would be another model's.

It is built from a full ``fit.Plan`` (one source for the weights, the reserve and the budget)
whose layout-bound figures it drops."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dspark.plan.facts import GiB
from dspark.plan.fit import Plan
from dspark.plan.inputs import PlanInputs

# Plan.to_dict's figures that come from the KV-cache layout.
_LAYOUT_KEYS = (
    "kv_bytes_per_token", "kv_block_size", "kv_num_blocks", "kv_tokens", "max_concurrency",
    "max_context_at_max_num_seqs", "full_length_requests", "admission_reserve_blocks",
    "admission_reserve_bytes", "max_model_len_that_fits", "kv_caches",
)


def weights_fit(per_rank: int, overhead: int, inputs: PlanInputs) -> bool:
    """Whether weights and reserve fit one rank, by the budget ``fit.plan_from_facts`` checks:
    gpu_memory_utilization x usable memory, or kv_cache_memory_bytes beside them in it."""
    if inputs.kv_cache_memory_bytes is not None:
        return per_rank + overhead + inputs.kv_cache_memory_bytes <= inputs.usable_memory_bytes
    return per_rank + overhead < int(inputs.gpu_memory_utilization * inputs.usable_memory_bytes)


@dataclass(frozen=True)
class WeightsOnlyPlan:
    plan: Plan                  # its KV-layout figures are not this model's
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @classmethod
    def from_plan(cls, plan: Plan, notes: list[str]) -> WeightsOnlyPlan:
        """The weights' verdict of ``plan``, with ``notes``; the plan's own notes and problems
        that rest on the KV layout are dropped."""
        fits = weights_fit(plan.weight_bytes_per_rank, plan.runtime_overhead_bytes, plan.inputs)
        # plan_from_facts checks the KV layout only once the weights fit: its problems then are
        # the weights' own.
        problems = [] if fits else list(plan.problems)
        unloaded = plan.weight_bytes - plan.loaded_weight_bytes
        if unloaded:  # the same statement plan_from_facts makes, which does not rest on the layout
            notes = [f"{unloaded / GiB:.2f} GiB of draft (MTP) weights are not loaded without speculative decoding",
                     *notes]
        return cls(plan, problems, notes)

    @property
    def inputs(self) -> PlanInputs:
        return self.plan.inputs

    @property
    def fits(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        out = self.plan.to_dict()
        out.update({key: None for key in _LAYOUT_KEYS})
        out.update(fits=self.fits, kv_layout_modelled=False, problems=list(self.problems),
                   notes=list(self.notes))
        return out

    def render_text(self) -> str:
        p, i = self.plan, self.plan.inputs

        def gib(n: float) -> str:
            return f"{n / GiB:,.2f} GiB"

        rows = [
            ("model", f"{i.model_dir} ({p.architecture})"),
            ("parallelism", f"TP={i.tensor_parallel_size} PP={i.pipeline_parallel_size}"),
            ("checkpoint weights", gib(p.weight_bytes)),
            ("loaded weights", gib(p.loaded_weight_bytes)),
            ("weights per rank", f"{gib(p.weight_bytes_per_rank)} ({gib(p.replicated_bytes)} replicated)"),
            ("runtime reserve per rank", gib(p.runtime_overhead_bytes)),
            ("memory per rank", gib(p.memory_per_rank_bytes)),
            ("KV cache per rank", f"{gib(p.kv_cache_bytes)} (its layout, and so its tokens, not modelled)"),
            ("fits", "yes" if self.fits else "NO"),
        ]
        width = max(len(k) for k, _ in rows)
        lines = [f"{k.ljust(width)}  {v}" for k, v in rows]
        lines += [f"problem: {x}" for x in self.problems]
        lines += [f"note: {x}" for x in self.notes]
        return "\n".join(lines) + "\n"
