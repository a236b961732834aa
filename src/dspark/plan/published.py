"""The published DeepSeek V4 Flash checkpoint, described without its 155 GiB: the tensor list
its 48 safetensors headers hold (name, dtype, shape), derived from the checkpoint's own
``config.json`` (shipped in dspark/data/deepseek-v4-flash/) by the conventions of the published
checkpoint. `dspark plan --published` plans with it, so the plan can be seen without the model.

The conventions, seen in public tooling that validates the checkpoint:
- native names (``layers.N.attn.wq_a.weight``, ``layers.N.ffn.experts.E.w1``, ``mtp.S.*``);
- FP8 e4m3 linear weights with one ue8m0 (F8_E8M0) scale per 128x128 block;
- MXFP4 routed experts stored as I8 with two values per byte, plus one ue8m0 scale per 32
  values;
- BF16 embeddings, norms, router and compressor weights; F32 hyper-connection (``hc_*``),
  attention-sink, compressor ``ape`` and router-bias tensors; I64 ``tid2eid`` hash tables in
  the ``num_hash_layers`` first layers;
- three DSpark draft stages ``mtp.0..2`` shaped like an uncompressed layer, plus
  ``mtp.0.main_proj``, ``mtp.0.main_norm``, ``mtp.2.norm``, ``mtp.2.hc_head_*``, the Markov
  head and the confidence head.
It reproduces the published figures (the same tooling): 72,317 tensors and an index
``total_size`` of 166,878,536,440 bytes in 48 shards of 166,886,535,336 bytes in all
(tests/test_plan.py checks both).
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from importlib import resources
from pathlib import Path

from .facts import ModelFacts, TensorInfo

NAME = "deepseek-v4-flash"
PUBLISHED_TENSOR_COUNT = 72_317
PUBLISHED_PAYLOAD_BYTES = 166_878_536_440
PUBLISHED_SHARD_BYTES = 166_886_535_336
PUBLISHED_SHARD_COUNT = 48

_WIDTH = {"F8_E4M3": 1, "F8_E8M0": 1, "I8": 1, "BF16": 2, "F32": 4, "I64": 8}


def config() -> dict:
    """The published checkpoint's config.json, as shipped with dspark."""
    return json.loads((resources.files("dspark") / "data" / NAME / "config.json").read_text())


def dsv4_tensors(cfg: dict) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, dtype, shape) of every tensor, derived from the config."""
    h = cfg["hidden_size"]
    vocab = cfg["vocab_size"]
    heads, head_dim = cfg["num_attention_heads"], cfg["head_dim"]
    q_rank, o_rank, groups = cfg["q_lora_rank"], cfg["o_lora_rank"], cfg["o_groups"]
    inter, experts = cfg["moe_intermediate_size"], cfg["n_routed_experts"]
    hc = cfg["hc_mult"]
    hc_mix = (2 + hc) * hc
    idx_heads, idx_dim = cfg["index_n_heads"], cfg["index_head_dim"]
    out: list[tuple[str, str, tuple[int, ...]]] = []

    def t(name: str, dtype: str, *shape: int) -> None:
        out.append((name, dtype, shape))

    def fp8(name: str, rows: int, cols: int) -> None:
        t(f"{name}.weight", "F8_E4M3", rows, cols)
        t(f"{name}.scale", "F8_E8M0", math.ceil(rows / 128), math.ceil(cols / 128))

    def mxfp4(name: str, rows: int, cols: int) -> None:
        t(f"{name}.weight", "I8", rows, cols // 2)
        t(f"{name}.scale", "F8_E8M0", rows, math.ceil(cols / 32))

    def layer(p: str, ratio: int, hashed: bool) -> None:
        t(f"{p}.attn_norm.weight", "BF16", h)
        t(f"{p}.ffn_norm.weight", "BF16", h)
        for part in ("attn", "ffn"):
            t(f"{p}.hc_{part}_fn", "F32", hc_mix, hc * h)
            t(f"{p}.hc_{part}_scale", "F32", 3)
            t(f"{p}.hc_{part}_base", "F32", hc_mix)
        t(f"{p}.attn.q_norm.weight", "BF16", q_rank)
        t(f"{p}.attn.kv_norm.weight", "BF16", head_dim)
        t(f"{p}.attn.attn_sink", "F32", heads)
        fp8(f"{p}.attn.wq_a", q_rank, h)
        fp8(f"{p}.attn.wq_b", heads * head_dim, q_rank)
        fp8(f"{p}.attn.wkv", head_dim, h)
        fp8(f"{p}.attn.wo_a", groups * o_rank, heads * head_dim // groups)
        fp8(f"{p}.attn.wo_b", h, groups * o_rank)
        t(f"{p}.ffn.gate.weight", "BF16", experts, h)
        if hashed:
            t(f"{p}.ffn.gate.tid2eid", "I64", vocab, cfg["num_experts_per_tok"])
        else:
            t(f"{p}.ffn.gate.bias", "F32", experts)
        fp8(f"{p}.ffn.shared_experts.w1", inter, h)
        fp8(f"{p}.ffn.shared_experts.w3", inter, h)
        fp8(f"{p}.ffn.shared_experts.w2", h, inter)
        for e in range(experts):
            mxfp4(f"{p}.ffn.experts.{e}.w1", inter, h)
            mxfp4(f"{p}.ffn.experts.{e}.w3", inter, h)
            mxfp4(f"{p}.ffn.experts.{e}.w2", h, inter)
        if ratio:
            coff = 2 if ratio == 4 else 1  # C4A compresses overlapping windows
            t(f"{p}.attn.compressor.ape", "F32", ratio, coff * head_dim)
            t(f"{p}.attn.compressor.wkv.weight", "BF16", coff * head_dim, h)
            t(f"{p}.attn.compressor.wgate.weight", "BF16", coff * head_dim, h)
            t(f"{p}.attn.compressor.norm.weight", "BF16", head_dim)
        if ratio == 4:
            fp8(f"{p}.attn.indexer.wq_b", idx_heads * idx_dim, q_rank)
            t(f"{p}.attn.indexer.weights_proj.weight", "BF16", idx_heads, h)
            t(f"{p}.attn.indexer.compressor.ape", "F32", ratio, 2 * idx_dim)
            t(f"{p}.attn.indexer.compressor.wkv.weight", "BF16", 2 * idx_dim, h)
            t(f"{p}.attn.indexer.compressor.wgate.weight", "BF16", 2 * idx_dim, h)
            t(f"{p}.attn.indexer.compressor.norm.weight", "BF16", idx_dim)

    t("embed.weight", "BF16", vocab, h)
    t("head.weight", "BF16", vocab, h)
    t("norm.weight", "BF16", h)
    t("hc_head_fn", "F32", hc, hc * h)
    t("hc_head_scale", "F32", 1)
    t("hc_head_base", "F32", hc)
    ratios = cfg["compress_ratios"]
    n_layers = cfg["num_hidden_layers"]
    for i in range(n_layers):
        layer(f"layers.{i}", ratios[i], i < cfg["num_hash_layers"])
    stages = len(ratios) - n_layers  # 3 DSpark stages in this config
    for s in range(stages):
        layer(f"mtp.{s}", 0, False)
    last = f"mtp.{stages - 1}"
    rank = cfg["dspark_markov_rank"]
    fp8("mtp.0.main_proj", h, len(cfg["dspark_target_layer_ids"]) * h)
    t("mtp.0.main_norm.weight", "BF16", h)
    t(f"{last}.norm.weight", "BF16", h)
    t(f"{last}.hc_head_fn", "F32", hc, hc * h)
    t(f"{last}.hc_head_base", "F32", hc)
    t(f"{last}.hc_head_scale", "F32", 1)
    t(f"{last}.markov_head.markov_w1.weight", "BF16", vocab, rank)
    t(f"{last}.markov_head.markov_w2.weight", "BF16", vocab, rank)
    t(f"{last}.confidence_head.proj.weight", "BF16", 1, h + rank)
    return out


def published_facts() -> ModelFacts:
    """What `load_model_facts` reads from the published checkpoint's directory (config.json and
    the safetensors headers), from the shipped description."""
    cfg = config()
    tensors = tuple(TensorInfo(name, dtype, shape, _WIDTH[dtype] * math.prod(shape), "published description")
                    for name, dtype, shape in dsv4_tensors(cfg))
    return ModelFacts(Path(f"published:{NAME}"), cfg, tensors,
                      PUBLISHED_SHARD_BYTES)


def plan_published(cluster=None):
    """The plan of the published checkpoint at `cluster`'s serving settings (a config.Cluster),
    or at the config's defaults (those of `dspark config init`) when there is none."""
    from ..config import ServingConfig
    from .fit import plan_from_facts
    from .from_cluster import plan_inputs

    if cluster is None:
        from types import SimpleNamespace

        cluster = SimpleNamespace(serving=ServingConfig(), model=SimpleNamespace(path="."))
    facts = published_facts()
    return plan_from_facts(facts, replace(plan_inputs(cluster), model_dir=facts.model_dir))
