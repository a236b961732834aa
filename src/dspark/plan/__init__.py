"""Memory fit plan: will a model fit the nodes, and with how much KV cache?

Everything is computed from the model directory alone: its ``config.json`` and
the JSON headers of its ``*.safetensors`` shards. Tensor data is never read, so
a plan for a 155 GiB checkpoint costs a few milliseconds.

The accounting follows vLLM 0.28.0 (the release the GB10 runtime pins):

* weights: every tensor's bytes come from the header's ``data_offsets``; which
  tensors are split across tensor-parallel ranks and which are replicated
  follows the layer types vLLM's model code builds them with (see
  ``_REPLICATED_DSV4`` and ``_SHARDED_HF``);
* KV cache: the KV-cache specs and the block arithmetic of
  ``vllm/v1/kv_cache_interface.py`` and ``vllm/v1/core/kv_cache_utils.py``
  (``get_kv_cache_groups``, ``_get_kv_cache_config_packed``,
  ``get_max_concurrency_for_kv_cache_config``), including DeepSeek V4's packed
  multi-group layout (``vllm/models/deepseek_v4/attention.py``,
  ``compressor.py``, ``v1/attention/backends/mla/sparse_swa.py``);
* the memory each rank can give: ``gpu_memory_utilization * usable memory``,
  or ``kv_cache_memory_bytes`` when set, as vLLM does.

``kv_tokens`` is the figure vLLM logs as "GPU KV cache size: N tokens": the
number of blocks over the blocks one ``max_model_len`` request needs, times
``max_model_len``. It is per rank: every rank holds the same block pool.

The concurrency figures (the context each of ``max_num_seqs`` requests runs with, how many
full-``max_model_len`` requests run at once, the admission reserve) follow vLLM's scheduler
and KV-cache manager, not a reservation model: ``fit.Scheduling`` says which rules, and
``benchmarks/plan_vs_scheduler.py`` compares them with vLLM's own Scheduler on CPU.

The package, one module per step: ``facts`` (model directory -> ModelFacts), ``inputs``
(PlanInputs: what the plan is asked), ``weights`` (the split per rank), ``kv_layout`` (bytes
per token as vLLM accounts them), ``fit`` (the budget and the verdict) and ``from_cluster``
(which of the cluster file's settings the plan reads; its defaults are the config's own).
"""

from __future__ import annotations
