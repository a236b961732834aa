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
"""

from __future__ import annotations

import json
import math
import struct
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

GiB = 1 << 30

# One GB10 node: "usable unified memory of one GB10 node: about 121 GiB"
# (shared/reference/deepseek-v4-flash.md, "Memory on one GB10 node").
GB10_USABLE_MEMORY_BYTES = 121 * GiB

# The seed's tested serving settings (shared/reference/deepseek-v4-flash.md,
# "The seed's serving command line").
SEED_MAX_MODEL_LEN = 350_000
SEED_MAX_NUM_SEQS = 12
SEED_MAX_NUM_BATCHED_TOKENS = 8192

# The safetensors format caps the header at 100 MB (safetensors' own
# MAX_HEADER_SIZE); anything larger is a corrupt or foreign file.
_MAX_HEADER_BYTES = 100_000_000

# vLLM's CUDA default (vllm/config/cache.py, CacheConfig.DEFAULT_BLOCK_SIZE).
_DEFAULT_BLOCK_SIZE = 16
# DeepSeek V4 runs with 256-token blocks: the seed passes --block-size 256 and
# vLLM's DSv4 caches are laid out for it ("The C4A KV block shape [256//4, ...]"
# in vllm/v1/attention/backends/mla/sparse_swa.py).
_DSV4_DEFAULT_BLOCK_SIZE = 256

# Runtime reserve for DeepSeek V4 (activation peak, CUDA graphs, non-torch
# allocations and the buffers vLLM allocates while building the model, such as
# RoPE caches), derived from the reference run on two GB10 nodes
# (deepseek-v4-flash.md: TP=2, gpu_memory_utilization 0.78, max_model_len
# 350000, 12 seqs, MTP 5 -> 79.17 GiB model memory, 10.74 GiB KV per rank):
#   0.78 * 121 GiB budget                      = 94.38 GiB
#   - 10.74 GiB KV cache                       = 83.64 GiB
#   - 78.42 GiB checkpoint weights on one rank (this module's figure for that
#     checkpoint at TP=2 with its drafter)     =  5.22 GiB
# vLLM reported 79.17 GiB of model memory, so 0.75 GiB of this reserve is the
# model-construction buffers and 4.47 GiB is the rest. It grows with
# max_num_batched_tokens and the CUDA-graph capture sizes; pass
# runtime_overhead_bytes to override it.
DSV4_RUNTIME_OVERHEAD_BYTES = round(5.22 * GiB)

# Bytes of one element of each safetensors dtype (the safetensors format's
# dtype list). Only used to check shapes against data_offsets; the byte count
# itself always comes from data_offsets.
_DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}

_KV_DTYPE_BYTES = {
    "bfloat16": 2, "float16": 2, "half": 2, "float32": 4, "float": 4,
    "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "fp8_inc": 1,
}


class PlanError(Exception):
    """The model directory cannot be planned; the message names the file."""


# --------------------------------------------------------------------------
# Model facts: config.json + safetensors headers
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    shard: str


@dataclass(frozen=True)
class ModelFacts:
    model_dir: Path
    config: dict[str, Any]
    tensors: tuple[TensorInfo, ...]
    shard_file_bytes: int  # the shards' sizes on disk, headers included

    @property
    def model_type(self) -> str:
        return str(self.config.get("model_type", ""))

    @property
    def architecture(self) -> str:
        archs = self.config.get("architectures") or [""]
        return str(archs[0])

    @property
    def is_deepseek_v4(self) -> bool:
        return self.model_type == "deepseek_v4" or "compress_ratios" in self.config

    @property
    def weight_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def bytes_by_dtype(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for t in self.tensors:
            out[t.dtype] = out.get(t.dtype, 0) + t.nbytes
        return dict(sorted(out.items()))


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise PlanError(f"{path}: missing (a model directory needs config.json)") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise PlanError(f"{path}: cannot read: {exc}") from None
    except json.JSONDecodeError as exc:
        raise PlanError(f"{path}: not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise PlanError(f"{path}: expected a JSON object")
    return data


def read_safetensors_header(path: Path) -> tuple[list[TensorInfo], int]:
    """Parse one shard's header; returns its tensors and its size on disk."""
    try:
        with path.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise PlanError(f"{path}: too short for a safetensors header")
            (n,) = struct.unpack("<Q", head)
            size = path.stat().st_size
            if n > _MAX_HEADER_BYTES or 8 + n > size:
                raise PlanError(f"{path}: corrupt safetensors header length {n}")
            raw = f.read(n)
    except OSError as exc:
        raise PlanError(f"{path}: cannot read: {exc}") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PlanError(f"{path}: corrupt safetensors header: {exc}") from None
    if not isinstance(header, dict):
        raise PlanError(f"{path}: corrupt safetensors header: not a JSON object")
    data_bytes = size - 8 - n
    tensors = []
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = str(meta["dtype"])
            shape = tuple(int(d) for d in meta["shape"])
            begin, end = (int(o) for o in meta["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise PlanError(f"{path}: corrupt safetensors header entry {name!r}") from None
        if not 0 <= begin <= end <= data_bytes:
            raise PlanError(
                f"{path}: tensor {name!r} lies outside the file (truncated download?)"
            )
        width = _DTYPE_BYTES.get(dtype)
        if width is not None and math.prod(shape) * width != end - begin:
            raise PlanError(f"{path}: tensor {name!r}: shape and data_offsets disagree")
        tensors.append(TensorInfo(name, dtype, shape, end - begin, path.name))
    return tensors, size


def load_model_facts(model_dir: Path | str) -> ModelFacts:
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise PlanError(f"{model_dir}: not a directory")
    config = _read_json(model_dir / "config.json")
    if not isinstance(config.get("num_hidden_layers"), int):
        raise PlanError(f"{model_dir / 'config.json'}: no integer num_hidden_layers")
    tensors: list[TensorInfo] = []
    shard_bytes = 0
    for shard in sorted(model_dir.glob("*.safetensors")):
        found, size = read_safetensors_header(shard)
        tensors.extend(found)
        shard_bytes += size
    return ModelFacts(model_dir, config, tuple(tensors), shard_bytes)


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


# --------------------------------------------------------------------------
# KV cache as vLLM 0.28.0 accounts it
# --------------------------------------------------------------------------


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _round_up(x: int, m: int) -> int:
    return _cdiv(x, m) * m


@dataclass(frozen=True)
class _Spec:
    """One layer's KV-cache spec: a full-attention or a sliding-window cache."""

    block_size: int   # tokens per block
    page_bytes: int   # bytes of one block of this layer
    window: int = 0   # 0: full attention

    def blocks_per_request(self, tokens: int, in_flight: int) -> int:
        if not self.window:  # FullAttentionSpec.max_memory_usage_bytes
            return _cdiv(tokens, self.block_size)
        # SlidingWindowSpec.max_admission_blocks_per_request (no extra retained
        # tokens: they apply only to multi-module "mtp" speculation, and
        # DeepSeek V4 has one nextn layer).
        held = min(self.window - 1 + in_flight, tokens)
        return _cdiv(held, self.block_size) + 1


@dataclass(frozen=True)
class KVLayout:
    """The block pool of one rank: a block costs block_stride bytes."""

    kind: str                        # "uniform" or "deepseek_v4"
    block_size: int                  # tokens per block of the full-attention group
    block_stride: int                # bytes one block id costs on a rank
    groups: tuple[_Spec, ...]        # one representative spec per cache group
    in_flight_tokens: int
    tuple_bytes: int = 0             # DSv4 start-up check (layer-tuple sizing)
    num_tuples: int = 0
    detail: tuple[tuple[str, int, int], ...] = ()  # (cache, layers, page bytes)

    def blocks_per_request(self, tokens: int) -> int:
        return sum(g.blocks_per_request(tokens, self.in_flight_tokens) for g in self.groups)

    def bytes_needed_for_one_request(self, tokens: int) -> int:
        """What vLLM's start-up check demands for one max_model_len request."""
        if self.kind == "deepseek_v4":
            # _max_memory_usage_bytes_from_groups, the all-UniformType case.
            pages = self.blocks_per_request(tokens)
            return self.num_tuples * pages * self.tuple_bytes
        return self.blocks_per_request(tokens) * self.block_stride

    @property
    def bytes_per_token(self) -> float:
        return self.block_stride / self.block_size


def _kv_dtype_bytes(kv_cache_dtype: str, config: dict[str, Any]) -> int:
    dtype = kv_cache_dtype
    if dtype == "auto":
        dtype = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
    dtype = dtype.removeprefix("torch.")
    if dtype.startswith("nvfp4"):
        raise PlanError(f"kv_cache_dtype {kv_cache_dtype!r} is only modelled for DeepSeek V4")
    try:
        return _KV_DTYPE_BYTES[dtype]
    except KeyError:
        raise PlanError(f"unknown kv_cache_dtype {kv_cache_dtype!r}") from None


def _uniform_layout(facts: ModelFacts, inputs: PlanInputs, block_size: int) -> KVLayout:
    """Ordinary attention: every layer has the same spec, one group."""
    cfg = facts.config
    tp, pp = inputs.tensor_parallel_size, inputs.pipeline_parallel_size
    layers = _cdiv(int(cfg["num_hidden_layers"]), pp)
    if cfg.get("kv_lora_rank"):
        # MLA (DeepSeek V2/V3): one latent per token, not split across ranks.
        if inputs.kv_cache_dtype == "fp8_ds_mla":
            token_bytes = 656  # V3.2's fp8_ds_mla envelope (deepseek-v4-flash.md)
        else:
            head = int(cfg["kv_lora_rank"]) + int(cfg.get("qk_rope_head_dim", 0))
            token_bytes = head * _kv_dtype_bytes(inputs.kv_cache_dtype, cfg)
        what = "mla"
    else:
        heads = int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
        # vLLM replicates KV heads when TP exceeds them: max(1, kv_heads // tp).
        kv_heads_per_rank = max(1, kv_heads // tp)
        token_bytes = 2 * kv_heads_per_rank * head_dim * _kv_dtype_bytes(
            inputs.kv_cache_dtype, cfg
        )
        what = "attention"
    page = block_size * token_bytes
    # get_num_blocks: available // page_size // num_layers
    return KVLayout(
        kind="uniform",
        block_size=block_size,
        block_stride=page * layers,
        groups=(_Spec(block_size, page),),
        in_flight_tokens=0,
        detail=((what, layers, page),),
    )


def _approximate_gcd(values: list[int], lower_bound: int) -> int:
    # kv_cache_utils._approximate_gcd: the divisor with least upward padding,
    # ties to the larger one.
    best, best_pad = lower_bound, None
    for d in range(lower_bound, max(max(values), lower_bound) + 1):
        pad = sum((d - x % d) % d for x in values)
        if best_pad is None or pad <= best_pad:
            best, best_pad = d, pad
    return best


def _dsv4_layout(facts: ModelFacts, inputs: PlanInputs, block_size: int) -> KVLayout:
    cfg = facts.config
    if inputs.pipeline_parallel_size != 1:
        raise PlanError("pipeline parallelism is not modelled for DeepSeek V4")
    dtype = inputs.kv_cache_dtype
    # Per-token content and page alignment of the MLA / SWA caches:
    #  fp8_ds_mla (stock 0.28.0; "fp8" is rewritten to it by the FlashMLA
    #   layout): 448 B fp8 NoPE + 128 B bf16 RoPE + 8 B scales = 584 B, pages
    #   padded to 576 B (attention.py, sparse_swa.py);
    #  nvfp4_ds_mla (the Spark overlay, spark-overlay.md section 1): the same
    #   584 B, pages aligned to 584 B;
    #  auto / bfloat16: a plain 512-value bf16 row, 512 B alignment.
    if dtype in ("fp8", "fp8_e4m3", "fp8_ds_mla"):
        token, align, aux_align = 584, 576, 576
    elif dtype in ("nvfp4", "nvfp4_ds_mla"):
        # The compressor-state and indexer caches test for "fp8_ds_mla" in the
        # stock code and fall back to 512 B; assumed unchanged by the overlay.
        token, align, aux_align = 584, 584, 512
    elif dtype in ("auto", "bfloat16"):
        token, align, aux_align = 2 * int(cfg["head_dim"]), 512, 512
    else:
        raise PlanError(f"kv_cache_dtype {dtype!r} is not modelled for DeepSeek V4")

    head_dim = int(cfg["head_dim"])
    index_dim = int(cfg.get("index_head_dim", 128))
    window = int(cfg.get("sliding_window", 128))
    n_layers = int(cfg["num_hidden_layers"])
    ratios = list(cfg["compress_ratios"])
    # Draft (MTP / DSpark) layers have their own SWA cache. Their number is the
    # compress_ratios entries past the main layers (1 for base Flash, 3 for the
    # DSpark variant, matching DSpark's n_mtp_layers default of 3).
    n_draft = max(0, len(ratios) - n_layers) if inputs.num_speculative_tokens else 0

    def page(storage_tokens: int, per_token: int, alignment: int) -> int:
        return _round_up(storage_tokens * per_token, alignment)

    full: list[tuple[str, int]] = []                 # (cache name, page bytes)
    swa: dict[tuple[int, int], list[tuple[str, int]]] = {}

    def add_swa(name: str, blk: int, win: int, page_bytes: int) -> None:
        swa.setdefault((blk, win), []).append((name, page_bytes))

    for layer in range(n_layers + n_draft):
        r = max(1, int(ratios[layer])) if layer < n_layers else 1
        # DeepseekV4SWACache: 64-token blocks, window = sliding_window.
        add_swa("swa", 64, window, page(64, token, align))
        if r == 1:
            continue
        # Compressed MLA cache: storage_block_size = block_size // ratio.
        full.append((f"c{r}a", page(block_size // r, token, align)))
        # CompressorStateCache: fp32 kv+score state, 2*coff*head_dim values.
        coff = 2 if r == 4 else 1
        add_swa(f"c{r}-state", 4 if r == 4 else 8, coff * r,
                page(4 if r == 4 else 8, 2 * coff * head_dim * 4, aux_align))
        if r == 4:
            # Indexer K cache: 128 fp8 + 4 B fp32 scale per 128 = 132 B/token.
            full.append(("c4-indexer", page(block_size // 4, index_dim + index_dim // 128 * 4,
                                            aux_align)))
            add_swa("c4-indexer-state", 4, 2 * 4,
                    page(4, 2 * 2 * index_dim * 4, aux_align))

    if not full:
        raise PlanError("DeepSeek V4 config without compressed layers is not modelled")

    # _get_kv_cache_groups_uniform_groups: layer tuples and SWA group splits.
    full_tuples = Counter(p for _, p in full).most_common(1)[0][1]
    swa_tuples = [Counter(p for _, p in specs).most_common(1)[0][1] for specs in swa.values()]
    n_tuples = _approximate_gcd([full_tuples, *swa_tuples], lower_bound=full_tuples)

    groups = [_Spec(block_size, sum(p for _, p in full))]
    stride = sum(p for _, p in full)
    max_group_tuples = full_tuples
    for (blk, win), specs in swa.items():
        sizes = Counter(p for _, p in specs)
        per_size = next(iter(sizes.values()))
        if any(c != per_size for c in sizes.values()):
            raise PlanError("uneven DeepSeek V4 sliding-window caches are not modelled")
        n_sub = _cdiv(per_size, n_tuples)
        for i in range(n_sub):
            tuples_here = len(range(i, per_size, n_sub))
            stride = max(stride, tuples_here * sum(sizes.keys()))
            max_group_tuples = max(max_group_tuples, tuples_here)
            groups.append(_Spec(blk, 0, win))

    in_flight = (
        (2 if inputs.async_scheduling else 1) * inputs.max_num_batched_tokens
    )  # VllmConfig.max_in_flight_tokens (async scheduling: 2 batches, PP 1)
    detail = Counter(name for name, _ in full) + Counter(
        name for specs in swa.values() for name, _ in specs
    )
    pages = {name: p for name, p in full}
    pages.update({name: p for specs in swa.values() for name, p in specs})
    return KVLayout(
        kind="deepseek_v4",
        block_size=block_size,
        block_stride=stride,
        groups=tuple(groups),
        in_flight_tokens=in_flight,
        tuple_bytes=sum(set(p for _, p in full)),
        num_tuples=max_group_tuples,
        detail=tuple((name, detail[name], pages[name]) for name in sorted(detail)),
    )


def kv_layout(facts: ModelFacts, inputs: PlanInputs) -> KVLayout:
    if facts.is_deepseek_v4:
        return _dsv4_layout(facts, inputs, inputs.block_size or _DSV4_DEFAULT_BLOCK_SIZE)
    return _uniform_layout(facts, inputs, inputs.block_size or _DEFAULT_BLOCK_SIZE)


# --------------------------------------------------------------------------
# The plan
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class PlanInputs:
    model_dir: Path
    tensor_parallel_size: int
    pipeline_parallel_size: int = 1
    max_model_len: int = SEED_MAX_MODEL_LEN
    max_num_seqs: int = SEED_MAX_NUM_SEQS
    block_size: int | None = None   # None: 256 for DeepSeek V4, else vLLM's 16
    kv_cache_dtype: str = "auto"
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    usable_memory_bytes: int = GB10_USABLE_MEMORY_BYTES
    num_speculative_tokens: int = 0
    # None: DSV4_RUNTIME_OVERHEAD_BYTES for DeepSeek V4; 0 for other models
    # (no calibrated figure; the plan says so in its notes).
    runtime_overhead_bytes: int | None = None
    max_num_batched_tokens: int = SEED_MAX_NUM_BATCHED_TOKENS
    async_scheduling: bool = True   # the seed serves with --async-scheduling

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


@dataclass(frozen=True)
class Plan:
    inputs: PlanInputs
    architecture: str
    fits: bool
    weight_bytes: int               # every tensor in the checkpoint
    checkpoint_file_bytes: int      # the shards on disk, headers included
    loaded_weight_bytes: int        # what vLLM loads (drafter only with speculation)
    weight_bytes_per_rank: int
    replicated_bytes: int           # held whole by every rank
    runtime_overhead_bytes: int
    memory_per_rank_bytes: int      # what the node gives vLLM
    kv_cache_bytes: int             # per rank, for the KV cache
    kv_bytes_per_token: float       # per rank, block padding included
    kv_block_size: int
    kv_num_blocks: int
    kv_tokens: int                  # vLLM's "KV cache size: N tokens" (per rank)
    max_concurrency: float          # requests of max_model_len at once
    max_context_at_max_num_seqs: int
    max_model_len_that_fits: int    # one request
    kv_caches: tuple[tuple[str, int, int], ...]
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        i = self.inputs
        return {
            "fits": self.fits,
            "model_dir": str(i.model_dir),
            "architecture": self.architecture,
            "tensor_parallel_size": i.tensor_parallel_size,
            "pipeline_parallel_size": i.pipeline_parallel_size,
            "max_model_len": i.max_model_len,
            "max_num_seqs": i.max_num_seqs,
            "kv_cache_dtype": i.kv_cache_dtype,
            "weight_bytes": self.weight_bytes,
            "checkpoint_file_bytes": self.checkpoint_file_bytes,
            "loaded_weight_bytes": self.loaded_weight_bytes,
            "weight_bytes_per_rank": self.weight_bytes_per_rank,
            "replicated_bytes": self.replicated_bytes,
            "runtime_overhead_bytes": self.runtime_overhead_bytes,
            "memory_per_rank_bytes": self.memory_per_rank_bytes,
            "kv_cache_bytes": self.kv_cache_bytes,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "kv_block_size": self.kv_block_size,
            "kv_num_blocks": self.kv_num_blocks,
            "kv_tokens": self.kv_tokens,
            "max_concurrency": round(self.max_concurrency, 4),
            "max_context_at_max_num_seqs": self.max_context_at_max_num_seqs,
            "max_model_len_that_fits": self.max_model_len_that_fits,
            "kv_caches": [
                {"cache": n, "layers": c, "page_bytes": p} for n, c, p in self.kv_caches
            ],
            "problems": list(self.problems),
            "notes": list(self.notes),
        }

    def render_text(self) -> str:
        i = self.inputs

        def gib(n: float) -> str:
            return f"{n / GiB:,.2f} GiB"

        rows = [
            ("model", f"{i.model_dir} ({self.architecture})"),
            ("parallelism", f"TP={i.tensor_parallel_size} PP={i.pipeline_parallel_size}"),
            ("checkpoint weights", gib(self.weight_bytes)),
            ("loaded weights", gib(self.loaded_weight_bytes)),
            ("weights per rank", f"{gib(self.weight_bytes_per_rank)}"
                                 f" ({gib(self.replicated_bytes)} replicated)"),
            ("runtime reserve per rank", gib(self.runtime_overhead_bytes)),
            ("memory per rank", gib(self.memory_per_rank_bytes)),
            ("KV cache per rank", gib(self.kv_cache_bytes)),
            ("KV bytes per token", f"{self.kv_bytes_per_token:,.1f}"
                                   f" ({i.kv_cache_dtype}, block {self.kv_block_size})"),
            ("KV tokens per rank", f"{self.kv_tokens:,}"),
            ("max_model_len", f"{i.max_model_len:,}"
                              f" (one request fits up to {self.max_model_len_that_fits:,})"),
            (f"context at {i.max_num_seqs} seqs", f"{self.max_context_at_max_num_seqs:,}"),
            ("fits", "yes" if self.fits else "NO"),
        ]
        width = max(len(k) for k, _ in rows)
        lines = [f"{k.ljust(width)}  {v}" for k, v in rows]
        lines += [f"problem: {p}" for p in self.problems]
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines) + "\n"


def _largest_context(layout: KVLayout, num_blocks: int, seqs: int, limit: int) -> int:
    """Largest L with seqs * blocks_per_request(L) <= num_blocks (0 if none).

    vLLM reserves blocks per request at admission with the same per-request
    bound it uses for the capacity figure (single_type_kv_cache_manager.py:
    min(cdiv(tokens, block), max_admission_blocks_per_request)), so this is the
    context each of `seqs` requests is sure to be admitted with.
    """
    lo, hi = 0, limit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if seqs * layout.blocks_per_request(mid) <= num_blocks:
            lo = mid
        else:
            hi = mid - 1
    return lo


def make_plan(inputs: PlanInputs) -> Plan:
    facts = load_model_facts(inputs.model_dir)
    return plan_from_facts(facts, inputs)


def plan_from_facts(facts: ModelFacts, inputs: PlanInputs) -> Plan:
    tp, pp = inputs.tensor_parallel_size, inputs.pipeline_parallel_size
    cfg = facts.config
    notes: list[str] = []
    problems: list[str] = []

    with_draft = inputs.num_speculative_tokens > 0
    weights = split_weights(facts, with_draft)
    per_rank = weights.per_rank(tp, pp)
    if not facts.tensors:
        notes.append(
            f"no *.safetensors shards in {facts.model_dir}: weights not counted "
            "(a config-only model served with --load-format dummy?)"
        )
    if weights.draft_bytes and not with_draft:
        notes.append(
            f"{weights.draft_bytes / GiB:.2f} GiB of draft (MTP) weights are not "
            "loaded without speculative decoding"
        )

    overhead = inputs.runtime_overhead_bytes
    if overhead is None:
        if facts.is_deepseek_v4:
            overhead = DSV4_RUNTIME_OVERHEAD_BYTES
        else:
            overhead = 0
            notes.append(
                "activation / CUDA-graph reserve not estimated for this model: "
                "set runtime_overhead_bytes, or kv_cache_memory_bytes"
            )

    layout = kv_layout(facts, inputs)
    budget = int(inputs.gpu_memory_utilization * inputs.usable_memory_bytes)
    if inputs.kv_cache_memory_bytes is not None:
        kv_bytes = inputs.kv_cache_memory_bytes
        memory_per_rank = per_rank + overhead + kv_bytes
        if memory_per_rank > inputs.usable_memory_bytes:
            room = inputs.usable_memory_bytes - per_rank - overhead
            problems.append(
                f"weights ({per_rank / GiB:.2f} GiB) + reserve ({overhead / GiB:.2f} GiB) "
                f"+ kv_cache_memory_bytes ({kv_bytes / GiB:.2f} GiB) exceed the "
                f"{inputs.usable_memory_bytes / GiB:.2f} GiB of one rank: "
                + (f"lower kv_cache_memory_bytes to {max(room, 0)}" if room > 0
                   else _raise_tp_hint(weights, inputs, overhead))
            )
    else:
        memory_per_rank = budget
        kv_bytes = max(0, budget - per_rank - overhead)
        if per_rank + overhead >= budget:
            problems.append(
                f"weights ({per_rank / GiB:.2f} GiB per rank) + reserve "
                f"({overhead / GiB:.2f} GiB) do not fit in gpu_memory_utilization "
                f"{inputs.gpu_memory_utilization} x {inputs.usable_memory_bytes / GiB:.2f} GiB"
                f" = {budget / GiB:.2f} GiB: " + _raise_tp_hint(weights, inputs, overhead)
            )

    num_blocks = kv_bytes // layout.block_stride
    per_request = layout.blocks_per_request(inputs.max_model_len)
    concurrency = num_blocks / per_request
    kv_tokens = int(concurrency * inputs.max_model_len)
    limit = int(cfg.get("max_position_embeddings") or inputs.max_model_len)
    limit = max(limit, inputs.max_model_len)
    one_request = _largest_context_bytes(layout, kv_bytes, limit)
    at_seqs = _largest_context(layout, num_blocks, inputs.max_num_seqs, limit)

    if not problems and layout.bytes_needed_for_one_request(inputs.max_model_len) > kv_bytes:
        problems.append(
            f"the KV cache ({kv_bytes / GiB:.2f} GiB per rank) cannot hold one request of "
            f"max_model_len {inputs.max_model_len:,}: lower max_model_len to "
            f"{one_request:,}, or give the KV cache more memory (gpu_memory_utilization, "
            "kv_cache_memory_bytes, a larger tensor_parallel_size)"
        )
    if not problems and at_seqs < inputs.max_model_len:
        seqs_full = int(concurrency)
        notes.append(
            f"{inputs.max_num_seqs} concurrent requests can hold {at_seqs:,} tokens each; "
            f"{seqs_full} request(s) of the full {inputs.max_model_len:,} tokens fit at once "
            f"(lower max_num_seqs to {max(seqs_full, 1)} to guarantee full-length requests)"
        )

    return Plan(
        inputs=inputs,
        architecture=facts.architecture,
        fits=not problems,
        weight_bytes=facts.weight_bytes,
        checkpoint_file_bytes=facts.shard_file_bytes,
        loaded_weight_bytes=weights.loaded_bytes,
        weight_bytes_per_rank=per_rank,
        replicated_bytes=weights.replicated_bytes,
        runtime_overhead_bytes=overhead,
        memory_per_rank_bytes=memory_per_rank,
        kv_cache_bytes=kv_bytes,
        kv_bytes_per_token=layout.bytes_per_token,
        kv_block_size=layout.block_size,
        kv_num_blocks=num_blocks,
        kv_tokens=kv_tokens,
        max_concurrency=concurrency,
        max_context_at_max_num_seqs=at_seqs,
        max_model_len_that_fits=one_request,
        kv_caches=layout.detail,
        problems=problems,
        notes=notes,
    )


def _largest_context_bytes(layout: KVLayout, kv_bytes: int, limit: int) -> int:
    """Largest max_model_len that passes vLLM's start-up check for one request."""
    lo, hi = 0, limit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if layout.bytes_needed_for_one_request(mid) <= kv_bytes:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _raise_tp_hint(weights: WeightSplit, inputs: PlanInputs, overhead: int) -> str:
    """Say which larger tensor_parallel_size (or utilization) would hold the weights."""
    budget = (
        inputs.usable_memory_bytes
        if inputs.kv_cache_memory_bytes is not None
        else int(inputs.gpu_memory_utilization * inputs.usable_memory_bytes)
    )
    hints = []
    tp = inputs.tensor_parallel_size * 2
    while tp <= 64:
        if weights.per_rank(tp, inputs.pipeline_parallel_size) + overhead < budget:
            hints.append(f"raise tensor_parallel_size to {tp}")
            break
        tp *= 2
    need = weights.per_rank(inputs.tensor_parallel_size, inputs.pipeline_parallel_size)
    need += overhead
    if inputs.kv_cache_memory_bytes is None and need < inputs.usable_memory_bytes:
        hints.append(
            f"raise gpu_memory_utilization above {need / inputs.usable_memory_bytes:.2f}"
        )
    return " or ".join(hints) if hints else "this model does not fit these nodes"
