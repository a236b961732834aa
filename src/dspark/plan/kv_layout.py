"""The KV-cache layout as vLLM 0.28.0 accounts it: bytes per token and per block, per group,
including DeepSeek V4's packed multi-group layout."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from dspark.plan.facts import _DEFAULT_BLOCK_SIZE, _DSV4_DEFAULT_BLOCK_SIZE, _KV_DTYPE_BYTES, ModelFacts, PlanError
from dspark.plan.inputs import PlanInputs

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


