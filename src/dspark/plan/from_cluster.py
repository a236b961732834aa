"""The plan of a cluster file: which of its settings the plan reads (`dspark plan`, and `dspark
serve` before it starts vLLM)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING

from dspark.lines import runtime as runtime_lines
from dspark.plan.facts import GiB, serving_default
from dspark.plan.fit import Plan, make_plan
from dspark.plan.inputs import PlanInputs

if TYPE_CHECKING:
    from dspark.config.schema import Cluster, ServingConfig


def line_kv_cache_dtype(serving: ServingConfig) -> str:
    """The KV-cache dtype vLLM runs: the cluster file's (the seed line's vocabulary) as the node's
    runtime line sends it (v0.32.0 sends the seed's nvfp4_ds_mla as fp8_ds_mla, whose pages are
    padded to 576 bytes); the file's own where the line refuses it (config check says so)."""
    dtype = serving.kv_cache_dtype or "auto"
    try:
        line = runtime_lines.load().get(serving.runtime_line)
        sent = runtime_lines.render_settings(line, {"kv_cache_dtype": dtype}).values["kv_cache_dtype"]
    except runtime_lines.LineRefusal:
        return dtype
    return sent or dtype


def plan_inputs(cluster: Cluster | SimpleNamespace, model_dir: Path | None = None) -> PlanInputs:
    """The plan's inputs from a config.Cluster (its serving section and model path)."""
    s = cluster.serving
    util = s.gpu_memory_utilization
    return PlanInputs(
        model_dir=Path(model_dir or cluster.model.path),
        tensor_parallel_size=s.tensor_parallel_size,
        pipeline_parallel_size=s.pipeline_parallel_size,
        max_model_len=s.max_model_len,
        max_num_seqs=s.max_num_seqs,
        block_size=s.block_size,
        kv_cache_dtype=line_kv_cache_dtype(s),
        # With kv_cache_memory_bytes set the utilization is not used; the config's default otherwise.
        gpu_memory_utilization=util if util is not None else serving_default("gpu_memory_utilization"),
        kv_cache_memory_bytes=s.kv_cache_memory_bytes,
        usable_memory_bytes=int(s.usable_memory_gib * GiB),
        num_speculative_tokens=s.num_speculative_tokens,
        max_num_batched_tokens=s.max_num_batched_tokens,
        async_scheduling=s.async_scheduling,
        # vLLM's default (0: no cap) for a config without the setting.
        long_prefill_token_threshold=getattr(s, "long_prefill_token_threshold", None) or 0,
    )


def plan_for_cluster(cluster: Cluster, model_dir: Path | None = None) -> Plan:
    return make_plan(plan_inputs(cluster, model_dir))
