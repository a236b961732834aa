"""What the plan is asked: the model directory, the parallelism and the serving settings it
reads (its defaults are the seed's, from ``facts``). Its own module so that ``kv_layout``
and ``fit`` both read it without importing each other."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dspark.plan.facts import (
    GB10_USABLE_MEMORY_BYTES,
    SEED_ASYNC_SCHEDULING,
    SEED_GPU_MEMORY_UTILIZATION,
    SEED_LONG_PREFILL_TOKEN_THRESHOLD,
    SEED_MAX_MODEL_LEN,
    SEED_MAX_NUM_BATCHED_TOKENS,
    SEED_MAX_NUM_SEQS,
    PlanError,
)


@dataclass(frozen=True)
class PlanInputs:
    model_dir: Path
    tensor_parallel_size: int
    pipeline_parallel_size: int = 1
    max_model_len: int = SEED_MAX_MODEL_LEN
    max_num_seqs: int = SEED_MAX_NUM_SEQS
    block_size: int | None = None   # None: 256 for DeepSeek V4, else vLLM's 16
    kv_cache_dtype: str = "auto"
    gpu_memory_utilization: float = SEED_GPU_MEMORY_UTILIZATION
    kv_cache_memory_bytes: int | None = None
    usable_memory_bytes: int = GB10_USABLE_MEMORY_BYTES
    num_speculative_tokens: int = 0
    # None: DSV4_RUNTIME_OVERHEAD_BYTES for DeepSeek V4; 0 for other models
    # (no calibrated figure; the plan says so in its notes).
    runtime_overhead_bytes: int | None = None
    max_num_batched_tokens: int = SEED_MAX_NUM_BATCHED_TOKENS
    async_scheduling: bool = SEED_ASYNC_SCHEDULING   # the seed serves with --async-scheduling
    long_prefill_token_threshold: int = SEED_LONG_PREFILL_TOKEN_THRESHOLD  # 0: no cap

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "max_model_len",
                     "max_num_seqs", "usable_memory_bytes", "max_num_batched_tokens"):
            if int(getattr(self, name)) < 1:
                raise PlanError(f"{name} must be at least 1")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise PlanError("gpu_memory_utilization must be in (0, 1]")
        if self.block_size is not None and self.block_size < 1:
            raise PlanError("block_size must be at least 1")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 0:
            raise PlanError("kv_cache_memory_bytes must not be negative")
        if self.num_speculative_tokens < 0:
            raise PlanError("num_speculative_tokens must not be negative")
        if self.long_prefill_token_threshold < 0:
            raise PlanError("long_prefill_token_threshold must not be negative")
