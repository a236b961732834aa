"""The published DeepSeek checkpoints, described without their weights: the tensor list each
one's 48 safetensors headers hold (name, dtype, shape), derived from its config by the
conventions of the published checkpoints. `dspark plan --published [--model NAME] [--nodes N]`
plans with them, so a plan can be seen without the model.

- ``deepseek-v4-flash``: the checkpoint's own ``config.json`` (dspark/data/deepseek-v4-flash/);
- ``deepseek-v4-flash-vision-exp``: the fields of its config.json that public sources show
  (dspark/data/deepseek-v4-flash-vision-exp/, SOURCES.md there) over V4-Flash's config, since it
  "has the same model structure as DeepSeek-V4-Flash-DSpark" (its Fireworks model page), plus
  the vision tower (published_vision);
- ``deepseek-v4.1-flash``: its own config.json (dspark/data/deepseek-v4.1-flash/) and its own
  derivation (published_v41); its KV-cache layout is not modelled (weights_only).

V4-Flash's conventions, seen in public tooling that validates the checkpoint:
- native names (``layers.N.attn.wq_a.weight``, ``layers.N.ffn.experts.E.w1``, ``mtp.S.*``);
- FP8 e4m3 linear weights with one ue8m0 (F8_E8M0) scale per 128x128 block;
- MXFP4 routed experts stored as I8 with two values per byte, plus one ue8m0 scale per 32
  values;
- BF16 embeddings, norms, router and compressor weights; F32 hyper-connection (``hc_*``),
  attention-sink, compressor ``ape`` and router-bias tensors; I64 ``tid2eid`` hash tables in
  the ``num_hash_layers`` first layers;
- three DSpark draft stages ``mtp.0..2`` shaped like an uncompressed layer, plus
  ``mtp.0.main_proj``, ``mtp.0.main_norm``, ``mtp.2.norm``, ``mtp.2.hc_head_*``, the Markov
  head and the confidence head;
- with a vision tower (``vision_n_layers`` > 0), an F32 vision routing bias ``gate.bias_vl`` on
  every MoE layer, the draft stages' included, and the routing bias on the hash layers too
  (vLLM 0.32.0 ``models/deepseek_v4/nvidia/model.py``: "Vision checkpoints ship a gate bias on
  hash layers too").
Each description reproduces its published index exactly (tests/plan/test_plan.py,
tests/plan/test_plan_published.py, tests/plan/test_plan_published_models.py): V4-Flash 72,317 tensors
and a ``total_size`` of 166,878,536,440 bytes in 48 shards of 166,886,535,336 bytes in all;
Vision-Exp 72,633 tensors and 167,811,372,792 bytes, its sorted names' SHA-256 (all, and
language, mtp and vision apart) and its vision tensors' dtypes and shapes; V4.1 96,085 tensors
and 510,286,023,000 bytes.

Which tensors a rank holds is dspark's DeepSeek V4 rule (weights.py). For the vision tower it
counts as split the 1.4 MiB that vLLM 0.32.0 holds whole on every rank (published_vision), and
for V4.1's Engram tables the average rank's rows where the fullest rank holds a few thousand
more (published_v41): under 0.01 GiB a rank, the figures' last digit.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, cast

from dspark.plan import published_v41
from dspark.plan.facts import GiB, ModelFacts, PlanError, TensorInfo
from dspark.plan.published_blocks import Tensors
from dspark.plan.published_vision import Tensor, replicated_by_vllm, vision_tensors

if TYPE_CHECKING:
    from dspark.config.schema import Cluster, ServingConfig
    from dspark.plan.fit import Plan
    from dspark.plan.weights_only import WeightsOnlyPlan

NAME = "deepseek-v4-flash"
VISION_EXP = "deepseek-v4-flash-vision-exp"
V41 = published_v41.NAME

PUBLISHED_TENSOR_COUNT = 72_317
PUBLISHED_PAYLOAD_BYTES = 166_878_536_440
PUBLISHED_SHARD_BYTES = 166_886_535_336
PUBLISHED_SHARD_COUNT = 48

_WIDTH = {"F8_E4M3": 1, "F8_E8M0": 1, "I8": 1, "BF16": 2, "F32": 4, "I64": 8}

# vLLM 0.32.0 is the first release a runtime line carries with DeepseekV41ForCausalLM in its model
# registry (vllm/model_executor/models/registry.py; 0.28.0's has none).
_V41_LINES = ("v0.32.0",)


def config() -> dict:
    """The published V4-Flash checkpoint's config.json, as shipped with dspark."""
    return json.loads((resources.files("dspark") / "data" / NAME / "config.json").read_text())


def vision_exp_fields() -> dict:
    """The fields of Vision-Exp's config.json that public sources show (SOURCES.md beside it)."""
    return json.loads((resources.files("dspark") / "data" / VISION_EXP / "fields.json").read_text())


def vision_exp_config() -> dict:
    """Vision-Exp's config as dspark plans it: V4-Flash's config with the fields read from
    Vision-Exp's own; those two share (hidden size, layers, experts, ...) must agree."""
    flash, fields = config(), vision_exp_fields()
    structural = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                  "vocab_size", "n_routed_experts", "num_experts_per_tok", "num_hash_layers",
                  "dspark_block_size", "dspark_target_layer_ids", "dspark_markov_rank")
    differ = [k for k in structural if flash.get(k) != fields.get(k)]
    if differ:
        raise PlanError(f"Vision-Exp's published fields differ from V4-Flash's config: {', '.join(differ)}")
    return {**flash, **fields}


def dsv4_tensors(cfg: dict) -> list[Tensor]:
    """(name, dtype, shape) of every tensor of the language model and its draft stages, derived
    from the config."""
    h = cfg["hidden_size"]
    vocab = cfg["vocab_size"]
    head_dim, q_rank = cfg["head_dim"], cfg["q_lora_rank"]
    experts = cfg["n_routed_experts"]
    hc = cfg["hc_mult"]
    idx_heads, idx_dim = cfg["index_n_heads"], cfg["index_head_dim"]
    vision = int(cfg.get("vision_n_layers") or 0) > 0
    rows = Tensors()
    out, t, fp8 = rows.out, rows.t, rows.fp8

    def layer(p: str, ratio: int, hashed: bool) -> None:
        rows.layer_head(p, cfg, experts)
        if hashed:
            t(f"{p}.ffn.gate.tid2eid", "I64", vocab, cfg["num_experts_per_tok"])
        if not hashed or vision:
            t(f"{p}.ffn.gate.bias", "F32", experts)
        if vision:
            t(f"{p}.ffn.gate.bias_vl", "F32", experts)
        rows.layer_experts(p, cfg, experts)
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


def vision_exp_tensors(cfg: dict) -> list[Tensor]:
    return dsv4_tensors(cfg) + vision_tensors(cfg, ("image_start", "image_end", "image_newline", "image_pad"))


@dataclass(frozen=True)
class Published:
    """One published checkpoint: its description and the figures of its published index."""

    name: str
    repo: str                   # the Hugging Face repository
    revision: str | None        # the revision the published figures are of, where known
    tensor_count: int
    payload_bytes: int          # the index's metadata.total_size
    shard_bytes: int | None     # the shard files on disk, headers included, where published
    config: Callable[[], dict]
    tensors: Callable[[dict], list[Tensor]]
    lines: Callable[[], tuple[str, ...]] | None = None  # the runtime lines that serve it (None: every line)

    def facts(self) -> ModelFacts:
        """What `load_model_facts` would read from the checkpoint's directory."""
        cfg = self.config()
        tensors = tuple(TensorInfo(name, dtype, shape, _WIDTH[dtype] * math.prod(shape), "published description")
                        for name, dtype, shape in self.tensors(cfg))
        return ModelFacts(Path(f"published:{self.name}"), cfg, tensors, self.shard_bytes or self.payload_bytes)


def _vision_lines() -> tuple[str, ...]:
    from dspark.lines import runtime as runtime_lines

    return tuple(line.id for line in runtime_lines.load().lines.values() if line.deepseek_v4_vision is not None)


CHECKPOINTS = {
    NAME: Published(NAME, "deepseek-ai/DeepSeek-V4-Flash", None, PUBLISHED_TENSOR_COUNT,
                    PUBLISHED_PAYLOAD_BYTES, PUBLISHED_SHARD_BYTES, config, dsv4_tensors),
    # mudler/vllm.cpp tests/parity/goldens/deepseek_v4_vision/index_manifest.json
    VISION_EXP: Published(VISION_EXP, "deepseek-ai/DeepSeek-V4-Flash-Vision-Exp", "86f746b", 72_633,
                          167_811_372_792, None, vision_exp_config, vision_exp_tensors, _vision_lines),
    # the DeepSeek-V4.1-Flash model receipt of revision df42c109 (published_v41)
    V41: Published(V41, "deepseek-ai/DeepSeek-V4.1-Flash", "df42c109", 96_085, 510_286_023_000, None,
                   published_v41.config, published_v41.dsv41_tensors, lambda: _V41_LINES),
}


def published(name: str) -> Published:
    try:
        return CHECKPOINTS[name]
    except KeyError:
        raise PlanError(f"no published checkpoint {name!r}: one of {', '.join(CHECKPOINTS)}") from None


def published_facts(name: str = NAME) -> ModelFacts:
    """What `load_model_facts` reads from the published checkpoint's directory (config.json and
    the safetensors headers), from the shipped description."""
    return published(name).facts()


def plan_published(cluster: Cluster | None = None, model: str = NAME,
                   nodes: int | None = None) -> Plan | WeightsOnlyPlan:
    """The plan of the published checkpoint ``model`` at `cluster`'s serving settings (a
    config.Cluster), or at the config's defaults (those of `dspark config init`) when there is
    none; on ``nodes`` nodes when given (tensor_parallel_size nodes x gpus_per_node), else the
    settings' own. A model the settings' runtime line cannot serve is planned on a line that
    serves it, and the plan says so. A fit.Plan, or for V4.1 a weights_only.WeightsOnlyPlan."""
    from dspark.config.schema import ServingConfig
    from dspark.plan.fit import plan_from_facts
    from dspark.plan.from_cluster import plan_inputs
    from dspark.plan.weights_only import WeightsOnlyPlan

    ckpt = published(model)
    serving = cluster.serving if cluster is not None else ServingConfig()
    changes: dict = {}
    notes: list[str] = []
    if nodes is not None:
        if nodes < 1:
            raise PlanError("--nodes must be at least 1")
        ranks = nodes * serving.gpus_per_node
        if ranks % serving.pipeline_parallel_size:
            raise PlanError(f"{nodes} nodes x {serving.gpus_per_node} GPUs do not divide into "
                            f"pipeline_parallel_size {serving.pipeline_parallel_size}")
        changes["tensor_parallel_size"] = ranks // serving.pipeline_parallel_size
    lines = ckpt.lines() if ckpt.lines is not None else None
    if lines is not None and serving.runtime_line not in lines:
        if not lines:
            raise PlanError(f"no runtime line dspark offers serves {ckpt.repo}")
        changes["runtime_line"] = lines[0]
        whose = "the cluster file's" if cluster is not None else "the default"
        notes.append(f"planned on the {lines[0]} line: {whose} {serving.runtime_line} cannot serve {ckpt.repo} "
                     f"(set serving.runtime_line = {lines[0]!r}, or `dspark switch {lines[0]}`)")
    serving = replace(serving, **changes)
    facts = ckpt.facts()
    inputs = plan_inputs(SimpleNamespace(serving=serving), facts.model_dir)
    plan = plan_from_facts(facts, inputs)
    if model != NAME:
        notes += _checkpoint_notes(ckpt, facts, inputs.tensor_parallel_size, serving)
    result = (WeightsOnlyPlan.from_plan(plan, notes) if model == V41
              else replace(plan, notes=plan.notes + notes) if notes else plan)
    return result if result.fits else _with_nodes_needed(result, ckpt, facts, serving)


def _checkpoint_notes(ckpt: Published, facts: ModelFacts, tp: int, serving: ServingConfig) -> list[str]:
    """What the plan of a published checkpoint other than V4-Flash rests on."""
    title = ckpt.repo.split("/")[1]
    tensors = {t.name: t.nbytes for t in facts.tensors}
    notes = [
        f"{title} (revision {ckpt.revision}) as dspark describes it: {len(tensors):,} tensors, "
        f"{facts.weight_bytes:,} bytes, its published index exactly (src/dspark/plan/published.py)",
        f"the runtime reserve is V4-Flash's, fitted on the v0.28.0 line at TP=2 (src/dspark/plan/facts.py); "
        f"{title}'s own under vLLM 0.32.0, its vision encoder's included, was not measured",
    ]
    tower = {name: n for name, n in tensors.items() if name.startswith(("vision.", "aligner.", "image_"))}
    whole = sum(n for name, n in tower.items() if replicated_by_vllm(name))
    notes.append(
        f"the vision tower and aligner ({sum(tower.values()) / GiB:.2f} GiB, {len(tower)} tensors) are split over the "
        f"ranks as vLLM 0.32.0 splits them at its default --mm-encoder-tp-mode weights, but for "
        f"{whole / 2**20:.1f} MiB it holds whole on every rank (patch embedding, norms, row-parallel biases, "
        "image vectors); --mm-encoder-tp-mode data holds all of it on every rank")
    limits = serving.limit_mm_per_prompt or {}
    if limits.get("image") == 0:
        notes.append(f"serving.limit_mm_per_prompt {{image = 0}}: vLLM 0.32.0 does not load the vision tower, "
                     f"so {sum(tower.values()) / GiB:.2f} GiB of the weights counted here are not loaded")
    if ckpt.name == VISION_EXP:
        notes.append(
            "the KV cache is V4-Flash's: Vision-Exp has its layers, and vLLM 0.32.0 widens the sliding window "
            f"by vision_max_n_token ({facts.config['vision_max_n_token']}) in the prefill index only, not in the "
            "cache (v1/attention/backends/mla/sparse_swa.py)")
    if ckpt.name == V41:
        cfg = facts.config
        per_rank = published_v41.engram_rows_per_rank(cfg, tp)
        row_bytes = cfg["engram_head_dim"] + cfg["engram_head_dim"] // 32  # FP8 row and its ue8m0 scales
        total = sum(cfg["engram_num_embeddings"]) * row_bytes
        notes += [
            f"the Engram tables ({total / GiB:.2f} GiB with their scales) are split by hash heads: "
            f"{sum(per_rank) * row_bytes / GiB:.2f} "
            f"GiB on the fullest rank at TP={tp}; vLLM 0.32.0 keeps them in pinned host memory (--engram-config "
            "cpu_offload, its default), which on a GB10 is the same unified memory, so they are counted in the "
            "weights per rank (whether its gpu_memory_utilization budget counts them was not established); "
            "vLLM 0.32.0 has no place for them off memory, where the public four-GB10 V4.1 run "
            "(MiaAI-Lab/DeepSeek-v4.1-Flash-DGX-Sparks, SGLang) keeps them on NVMe",
            "V4.1's KV-cache layout is not modelled: its compressed caches are written by the "
            f"{len(cfg['kv_source_layer_ids'])} kv_source_layer_ids only (ratios 2 and 1) and read by the other "
            "layers, its indexer is two-level, and vLLM 0.32.0 takes only fp8 KV for it on SM12x; dspark's layout "
            "is V4's (a C4A or C128A cache per layer), so this plan gives the memory left for the KV cache, not "
            "its tokens",
        ]
    return notes


def _with_nodes_needed(result: Plan | WeightsOnlyPlan, ckpt: Published, facts: ModelFacts,
                       serving: ServingConfig) -> Plan | WeightsOnlyPlan:
    """Add the verdict in nodes: how many the weights and the reserve need, when they do not fit."""
    from dspark.plan.weights import split_weights
    from dspark.plan.weights_only import weights_fit

    p = cast("Plan", getattr(result, "plan", result))  # a WeightsOnlyPlan's full plan
    inputs = p.inputs
    tp, gpus = inputs.tensor_parallel_size, serving.gpus_per_node
    if weights_fit(p.weight_bytes_per_rank, p.runtime_overhead_bytes, inputs):
        return result  # the weights fit: what does not is the plan's own problem (the KV cache)
    split = split_weights(facts, inputs.num_speculative_tokens > 0)
    # vLLM splits the attention heads and the output groups evenly over the ranks
    # (models/deepseek_v4*/attention.py: n_heads // tp, o_groups // tp).
    groups, heads = facts.config["o_groups"], facts.config["num_attention_heads"]
    fitting = [n for n in range(tp + 1, groups + 1)
               if groups % n == 0 and heads % n == 0 and n % gpus == 0
               and weights_fit(split.per_rank(n, 1), p.runtime_overhead_bytes, inputs)]
    title = ckpt.repo.split("/")[1]
    budget = (f"{int(inputs.gpu_memory_utilization * inputs.usable_memory_bytes) / GiB:.2f} GiB "
              "(gpu_memory_utilization "
              f"{inputs.gpu_memory_utilization} x {inputs.usable_memory_bytes / GiB:.2f} GiB)"
              if inputs.kv_cache_memory_bytes is None else f"{inputs.usable_memory_bytes / GiB:.2f} GiB")
    nodes = tp // gpus
    head = (f"{title}: {p.loaded_weight_bytes / GiB:.2f} GiB of weights, {p.weight_bytes_per_rank / GiB:.2f} GiB a "
            f"rank on {nodes} node{'s' if nodes != 1 else ''} and a {p.runtime_overhead_bytes / GiB:.2f} GiB reserve, "
            f"where each rank has {budget}: ")
    if fitting:
        n = fitting[0] // gpus
        head += (f"needs {n} nodes ({split.per_rank(fitting[0], 1) / GiB:.2f} GiB a rank at TP={fitting[0]}; "
                 f"dspark plan --published --model {ckpt.name} --nodes {n})")
    else:
        head += f"it does not fit up to TP={groups}, the most its {groups} output groups allow"
    return replace(result, problems=[head, *result.problems])
