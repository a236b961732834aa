"""DeepSeek-V4.1-Flash described without its 475 GiB: its config.json (shipped in
dspark/data/deepseek-v4.1-flash/, SOURCES.md there names the source) and every tensor of its 48
safetensors headers (name, dtype, shape), derived from the config.

The names are the published key set (96,085 keys, 2,401 under ``mtp.``; ISEEKYAN/Megatron-LM,
``experimental/lite/docs/contracts/deepseek_v41/weights.json`` at revision df42c109). No header
dump was found, so the dtypes and shapes are what vLLM 0.32.0 builds for each name
(``models/deepseek_v41/``) in the checkpoint conventions of V4-Flash, with V4.1's own
``weight_block_size`` [32, 32]:
- FP8 e4m3 linear weights with one ue8m0 scale per 32 x 32 block; MXFP4 routed experts (I8, two
  values a byte, one ue8m0 scale per 32 values); BF16 embeddings, norms, routers, compressors,
  indexer ``weights_proj`` and ``wk``; F32 ``hc_*``, attention sinks and router biases;
- V4.1's attention: a compressor only on the ``kv_source_layer_ids`` (``wkv`` and ``norm``, and
  ``wgate`` where the ratio pools, > 1), an indexer on the ``index_source_layer_ids`` (``wq_b``,
  ``weights_proj``) with its own keys (``wk``, ``k_norm``) on the KV sources only; no hash
  layers, no ``hc_head`` (``vllm/models/deepseek_v41/nvidia/model.py``: "v4.1 has no learned
  hc_head");
- a routing bias and a vision routing bias (``gate.bias``, ``gate.bias_vl``) on every MoE layer,
  the DSpark stages' included; the stages have ``dspark_n_routed_experts`` experts;
- Engram on ``engram_layer_ids``: a table of ``engram_num_embeddings`` FP8 rows of
  ``engram_head_dim`` with one ue8m0 scale per 32 values (``common/engram.py``:
  ``ParallelEngramEmbedding``), ``wkv`` (FP8, (max_ngram_size - 1) x n_heads x head_dim ->
  hidden x (hc_mult + 1)), ``q_weight`` and ``k_weight`` (BF16, hc_mult x hidden);
- the vision tower of Vision-Exp at V4.1's hidden size, without ``image_pad`` (published_vision).
The result is the published index exactly: 96,085 tensors and a ``total_size`` of
510,286,023,000 bytes (the model receipt of revision df42c109; tests/plan/test_plan_published_models.py
checks both), and each Engram layer's six tensors come to the 101,535,150,272 and
101,537,925,968 bytes that receipt gives for shards 47 and 48, which hold them.

Engram rows per rank: vLLM 0.32.0 splits each table across the tensor-parallel ranks by its hash
heads (``ParallelEngramEmbedding``: ceil(heads / TP) heads a rank), each head a prime-sized range
of rows (``EngramLayout``: the primes above ``engram_vocab_size - 1``, drawn in order, never
reused). Those primes sum to ``engram_num_embeddings`` exactly, which ``engram_head_rows`` checks.
"""

from __future__ import annotations

import json
import math
from importlib import resources

from dspark.plan.published_blocks import Tensors
from dspark.plan.published_vision import Tensor, vision_tensors

NAME = "deepseek-v4.1-flash"

# vLLM 0.32.0's DeepseekV41Config (transformers_utils/configs/deepseek_v41.py) flattens
# vision_config onto the top level under the DeepSeek V4 names.
_VISION_NAMES = {
    "num_hidden_layers": "vision_n_layers", "hidden_size": "vision_dim",
    "num_attention_heads": "vision_n_heads", "intermediate_size": "vision_inter_dim",
    "patch_size": "vision_patch_size", "rope_theta": "vision_rope_theta",
    "downsample_ratio": "vision_downsample_ratio", "max_image_tokens": "vision_max_n_token",
    "min_pixels": "vision_min_pixels", "max_wh_ratio": "vision_max_wh_ratio",
}


def checkpoint_config() -> dict:
    """The checkpoint's config.json (nested: text_config, vision_config), as shipped."""
    return json.loads((resources.files("dspark") / "data" / NAME / "config.json").read_text())


def config() -> dict:
    """The config flat, as vLLM 0.32.0 reads it: text_config's fields at the top level, the
    vision fields under their ``vision_*`` names, ``expert_dtype`` from quantization_config."""
    nested = checkpoint_config()
    flat = {k: v for k, v in nested.items() if k not in ("text_config", "vision_config")}
    flat.update({k: v for k, v in nested["text_config"].items() if k != "model_type"})
    flat.update({_VISION_NAMES[k]: v for k, v in nested["vision_config"].items() if k in _VISION_NAMES})
    flat["expert_dtype"] = nested["quantization_config"]["expert_dtype"]
    return flat


def _is_prime(n: int) -> bool:
    if n < 2 or n % 2 == 0:
        return n == 2
    return all(n % d for d in range(3, math.isqrt(n) + 1, 2))


def engram_head_rows(cfg: dict) -> list[list[int]]:
    """Rows of each hash head, per Engram layer: consecutive primes above engram_vocab_size - 1
    ((max_ngram_size - 1) x n_heads a layer), checked against engram_num_embeddings."""
    heads = (cfg["engram_max_ngram_size"] - 1) * cfg["engram_n_heads"]
    primes: list[int] = []
    candidate = cfg["engram_vocab_size"] - 1
    while len(primes) < heads * len(cfg["engram_layer_ids"]):  # a few dozen primes near 1.6e7
        candidate += 1
        if _is_prime(candidate):
            primes.append(candidate)
    layers = [primes[i * heads:(i + 1) * heads] for i in range(len(cfg["engram_layer_ids"]))]
    if [sum(rows) for rows in layers] != list(cfg["engram_num_embeddings"]):
        raise ValueError("Engram hash heads do not sum to engram_num_embeddings")
    return layers


def engram_rows_per_rank(cfg: dict, tp: int) -> list[int]:
    """The most Engram rows one rank holds, per Engram layer, at tensor-parallel size ``tp``."""
    out = []
    for rows in engram_head_rows(cfg):
        part = math.ceil(len(rows) / tp)
        out.append(max(sum(rows[r * part:(r + 1) * part]) for r in range(tp)))
    return out


def dsv41_tensors(cfg: dict) -> list[Tensor]:
    """(name, dtype, shape) of every tensor, derived from the flat config."""
    h, vocab = cfg["hidden_size"], cfg["vocab_size"]
    head_dim, q_rank = cfg["head_dim"], cfg["q_lora_rank"]
    hc = cfg["hc_mult"]
    idx_heads, idx_dim = cfg["index_n_heads"], cfg["index_head_dim"]
    row_block, col_block = cfg["quantization_config"]["weight_block_size"]
    ratios, n_layers = cfg["compress_ratios"], cfg["num_hidden_layers"]
    kv_sources, index_sources = set(cfg["kv_source_layer_ids"]), set(cfg["index_source_layer_ids"])
    engram = dict(zip(cfg["engram_layer_ids"], cfg["engram_num_embeddings"], strict=True))
    engram_dim = cfg["engram_head_dim"]
    engram_in = (cfg["engram_max_ngram_size"] - 1) * cfg["engram_n_heads"] * engram_dim
    rows = Tensors((row_block, col_block))
    out, t, fp8 = rows.out, rows.t, rows.fp8

    def layer(p: str, i: int, experts: int) -> None:
        rows.layer_head(p, cfg, experts)
        t(f"{p}.ffn.gate.bias", "F32", experts)
        t(f"{p}.ffn.gate.bias_vl", "F32", experts)
        rows.layer_experts(p, cfg, experts)
        if i in kv_sources:
            t(f"{p}.attn.compressor.wkv.weight", "BF16", head_dim, h)
            t(f"{p}.attn.compressor.norm.weight", "BF16", head_dim)
            if ratios[i] > 1:  # ratio 1 projects single tokens: no gate
                t(f"{p}.attn.compressor.wgate.weight", "BF16", head_dim, h)
            t(f"{p}.attn.indexer.wk.weight", "BF16", idx_dim, head_dim)
            t(f"{p}.attn.indexer.k_norm.weight", "BF16", idx_dim)
        if i in index_sources:
            fp8(f"{p}.attn.indexer.wq_b", idx_heads * idx_dim, q_rank)
            t(f"{p}.attn.indexer.weights_proj.weight", "BF16", idx_heads, h)
        if i in engram:
            t(f"{p}.engram.embed.weight", "F8_E4M3", engram[i], engram_dim)
            t(f"{p}.engram.embed.scale", "F8_E8M0", engram[i], engram_dim // 32)
            fp8(f"{p}.engram.wkv", h * (hc + 1), engram_in)
            t(f"{p}.engram.q_weight", "BF16", hc, h)
            t(f"{p}.engram.k_weight", "BF16", hc, h)

    t("embed.weight", "BF16", vocab, h)
    t("head.weight", "BF16", vocab, h)
    t("norm.weight", "BF16", h)
    for i in range(n_layers):
        layer(f"layers.{i}", i, cfg["n_routed_experts"])
    stages = len(cfg["dspark_target_layer_ids"])  # 3 DSpark stages: ratios 40..42 are 0
    for s in range(stages):
        layer(f"mtp.{s}", n_layers + s, cfg["dspark_n_routed_experts"])
    last, rank = f"mtp.{stages - 1}", cfg["dspark_markov_rank"]
    fp8("mtp.0.main_proj", h, stages * h)
    t("mtp.0.main_norm.weight", "BF16", h)
    t(f"{last}.norm.weight", "BF16", h)
    t(f"{last}.markov_head.embed.weight", "BF16", vocab, rank)
    t(f"{last}.markov_head.head.weight", "BF16", vocab, rank)
    t(f"{last}.confidence_head.proj.weight", "BF16", 1, h + rank)
    out += vision_tensors(cfg, ("image_start", "image_end", "image_newline"))
    return out
