"""The dashboard's view of vLLM's /metrics: it lives in dspark.vllm_metrics (re-exported here)."""

from ..vllm_metrics import (  # noqa: F401
    COUNTERS, GAUGES, HISTOGRAMS, REQUIRED, WANTED, Histogram, MetricsError, Scrape, parse, relevant_lines,
)
