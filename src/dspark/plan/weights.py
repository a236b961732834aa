"""The weight split: which tensors each tensor-parallel rank holds (split or replicated, as
vLLM's model code builds the layers)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from dspark.plan.facts import ModelFacts

# --------------------------------------------------------------------------
# Which weights each tensor-parallel rank holds
# --------------------------------------------------------------------------

# DeepSeek V4 checkpoints use DeepSeek's native names (layers.N.attn.wq_a...).
# Replicated on every rank in vLLM 0.28.0 (vllm/models/deepseek_v4/):
#   attn.wq_a + attn.wkv   -> fused_wqa_wkv, MergedColumnParallelLinear(disable_tp=True)
#   attn.compressor.*      -> fused_wkv_wgate (disable_tp=True), ape, norm
#   attn.indexer.*         -> ReplicatedLinear wq_b / weights_proj, its compressor
#   ffn.gate.*             -> GateLinear (a ReplicatedLinear), bias, tid2eid
#   hc_* , norms           -> plain parameters
#   mtp.0.main_proj        -> ReplicatedLinear (nvidia/dspark.py)
#   markov_head, confidence_head -> replicated (qwen3_dspark.py: DSparkMarkovHead)
# Everything else is split: wq_b / wo_a (ColumnParallel), wo_b (RowParallel),
# shared experts (MergedColumn/RowParallel), routed experts (FusedMoE, TP over
# the intermediate size), embed / head (VocabParallel), attn_sink (per head).
_REPLICATED_DSV4 = (
    ".attn.wq_a.", ".attn.wkv.", ".attn.compressor.", ".attn.indexer.",
    ".ffn.gate.", "norm.weight", "main_proj.", "markov_head.", "confidence_head.",
)

# Hugging Face names of the layers vLLM builds as Column/RowParallel or
# VocabParallel (llama.py, deepseek_v2.py, qwen2/3, mixtral...). Everything not
# matched (norms, routers "mlp.gate.", biases of replicated layers) is counted
# as replicated. Approximation: KV projections are replicated by vLLM when
# tensor_parallel_size exceeds num_key_value_heads; that is not modelled.
_SHARDED_HF = (
    "q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj", "q_b_proj",
    "kv_b_proj", "gate_proj", "up_proj", "down_proj", "gate_up_proj",
    "experts.", "embed_tokens", "lm_head", "dense_h_to_4h", "dense_4h_to_h",
    "query_key_value", "c_attn", "c_proj", "c_fc", "wte",
)


def _is_draft_tensor(facts: ModelFacts, name: str) -> bool:
    """Tensors of the MTP / DSpark draft layers, loaded only with speculation."""
    if name.startswith("mtp."):
        return True
    n_layers = int(facts.config["num_hidden_layers"])
    parts = name.split(".")
    if len(parts) > 2 and parts[0] == "model" and parts[1] == "layers":
        return parts[2].isdigit() and int(parts[2]) >= n_layers
    return False


def _is_replicated(facts: ModelFacts, name: str) -> bool:
    if facts.is_deepseek_v4:
        last = name.rsplit(".", 1)[-1]
        return any(k in name for k in _REPLICATED_DSV4) or last.startswith("hc_")
    return not any(k in name for k in _SHARDED_HF)


@dataclass(frozen=True)
class WeightSplit:
    loaded_bytes: int      # the tensors vLLM loads (drafter only with speculation)
    replicated_bytes: int
    sharded_bytes: int
    draft_bytes: int       # mtp.* / draft layers in the checkpoint

    def per_rank(self, tp: int, pp: int) -> int:
        # Pipeline stages are approximated as an even split of all weights.
        return math.ceil((self.replicated_bytes + math.ceil(self.sharded_bytes / tp)) / pp)


def split_weights(facts: ModelFacts, with_draft: bool) -> WeightSplit:
    replicated = sharded = draft = 0
    for t in facts.tensors:
        is_draft = _is_draft_tensor(facts, t.name)
        if is_draft:
            draft += t.nbytes
            if not with_draft:
                continue
        if _is_replicated(facts, t.name):
            replicated += t.nbytes
        else:
            sharded += t.nbytes
    return WeightSplit(replicated + sharded, replicated, sharded, draft)


