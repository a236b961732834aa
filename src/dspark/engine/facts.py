"""Everything dspark assumes about vLLM's outside: log lines, metric names, endpoints.

They change between vLLM releases; this is the one module to update. Read on vLLM 0.28.0
(the release the runtime pins), by running the real CPU build as a two-node pair.
"""

from __future__ import annotations

VLLM_RELEASE = "0.28.0"

# --- progress markers in vLLM's log (substring -> the node state it announces) -------------
# Order matters: later stages win when several lines arrive together.
LOG_STAGES: tuple[tuple[str, str], ...] = (
    # a headless rank announces that it waits for the head's process group
    ("headless multiproc executor", "rendezvous"),
    # every rank prints this when it joins torch.distributed (it blocks until all have joined)
    ("distributed_init_method=", "rendezvous"),
    ("Starting to load model", "loading"),
    ("Loading weights", "loading"),
    ("Warming up model", "warming"),
    ("Memory profiling takes", "warming"),
    ("KV cache size", "warming"),
    ("Capturing CUDA graphs", "warming"),
    ("init engine", "warming"),
    ("Starting vLLM server on", "warming"),
)
STAGE_ORDER = ("starting", "rendezvous", "loading", "warming")
# The API server logs this from its SIGINT/SIGTERM handler alone (entrypoints/launcher.py): a
# stop someone asked for, not an engine that died (that ends the server without it).
LOG_SHUTDOWN_SIGNALLED = "[shutdown] API server: shutdown triggered"

# vLLM's own report of its KV capacity, e.g. "GPU KV cache size: 123,456 tokens".
KV_CACHE_TOKENS_LINE = "KV cache size"

# --- HTTP API of rank 0 ------------------------------------------------------------------
HEALTH = "/health"
VERSION = "/version"
MODELS = "/v1/models"
METRICS = "/metrics"
COMPLETIONS = "/v1/completions"
# /v1/models: each entry's "id" is a served name and "max_model_len" the longest context.
MODELS_MAX_LEN_FIELD = "max_model_len"

# --- Prometheus metric families (as prometheus_client's parser names them: counters lose
# their `_total` suffix in the family name, samples keep it) -----------------------------
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"
PROMPT_TOKENS = "vllm:prompt_tokens"
PROMPT_TOKENS_CACHED = "vllm:prompt_tokens_cached"
PREEMPTIONS = "vllm:num_preemptions"
GENERATION_TOKENS = "vllm:generation_tokens"
REQUEST_SUCCESS = "vllm:request_success"
# vllm:request_success counts every finished request, by why it finished (vLLM 0.28.0's
# v1/engine FinishReason: stop, length, abort, error, repetition). "abort": the client went away
# (or the server aborted it at a stop); "error": a request-level internal error (an HTTP 500).
FINISHED_REASON_LABEL = "finished_reason"
FINISHED_ABORT = "abort"
FINISHED_ERROR = "error"
PREFIX_CACHE_QUERIES = "vllm:prefix_cache_queries"
PREFIX_CACHE_HITS = "vllm:prefix_cache_hits"
SPEC_DRAFTS = "vllm:spec_decode_num_drafts"
SPEC_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
SPEC_ACCEPTED_TOKENS = "vllm:spec_decode_num_accepted_tokens"
TTFT = "vllm:time_to_first_token_seconds"
ITL = "vllm:inter_token_latency_seconds"
E2E = "vllm:e2e_request_latency_seconds"
PREFILL_TIME = "vllm:request_prefill_time_seconds"
PREFILL_KV_COMPUTED = "vllm:request_prefill_kv_computed_tokens"
REQUEST_PROMPT_TOKENS = "vllm:request_prompt_tokens"
REQUEST_GENERATION_TOKENS = "vllm:request_generation_tokens"
# Every sample carries these labels; one server may serve several engines (data parallel).
MODEL_LABEL = "model_name"
ENGINE_LABEL = "engine"
# An info gauge (value 1) whose labels are the KV-cache settings: block_size, cache_dtype,
# enable_prefix_caching, num_gpu_blocks, kv_cache_size_tokens, ...
CACHE_CONFIG_INFO = "vllm:cache_config_info"
# Written by prometheus_client's process collector into vLLM's /metrics: a change means the
# API server restarted, so every counter started again from zero.
PROCESS_START_TIME = "process_start_time_seconds"
