"""Bench's view of vLLM's /metrics: it lives in dspark.vllm_metrics (re-exported here)."""

from ..vllm_metrics import (  # noqa: F401
    COUNT, SUM, TOTAL, Snapshot, SpecDecode, Window, spec_decode, window,
)
from ..vllm_metrics import parse_samples as parse  # noqa: F401
