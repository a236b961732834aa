"""The cluster file's view of the memory plan: which of its settings the plan reads."""

from __future__ import annotations

from pathlib import Path

from .config import GIB, Cluster
from .plan import Plan, PlanInputs, make_plan


def plan_inputs(cluster: Cluster, model_dir: Path | None = None) -> PlanInputs:
    s = cluster.serving
    return PlanInputs(
        model_dir=Path(model_dir or cluster.model.path),
        tensor_parallel_size=s.tensor_parallel_size,
        pipeline_parallel_size=s.pipeline_parallel_size,
        max_model_len=s.max_model_len,
        max_num_seqs=s.max_num_seqs,
        block_size=s.block_size,
        kv_cache_dtype=s.kv_cache_dtype or "auto",
        gpu_memory_utilization=s.gpu_memory_utilization if s.gpu_memory_utilization is not None else 0.9,
        kv_cache_memory_bytes=s.kv_cache_memory_bytes,
        usable_memory_bytes=int(s.usable_memory_gib * GIB),
        num_speculative_tokens=s.num_speculative_tokens,
        max_num_batched_tokens=s.max_num_batched_tokens,
        async_scheduling=s.async_scheduling,
    )


def plan_for_cluster(cluster: Cluster, model_dir: Path | None = None) -> Plan:
    return make_plan(plan_inputs(cluster, model_dir))
