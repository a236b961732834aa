"""vLLM 0.32.0's own fp8_ds_mla layout for DeepSeek V4 on SM12x (the SM120 FlashInfer class),
the format the seed's nvfp4_ds_mla is sent as on the v0.32.0 line (0002 is not carried).

Run in the line's own Python with a stock (or the line-patched) vLLM 0.32.0 tree first on PYTHONPATH:
``python fp8_ds_mla_checks.py SITE`` (tests/overlay/test_line_v032.py does). Prints one JSON object
after @@RESULTS@@: check name -> "ok" or the failure's traceback (tensor_checks.run_all, as
line032_checks.py does).

What 0.32.0 gives, against the v0.28.0 line's nvfp4_ds_mla (0002: the same 584-byte token, pages
unpadded at alignment 584):
- the token: 584 bytes, laid out per page as T rows of 576 data bytes (448 e4m3 NoPE, 64 bf16 RoPE)
  then T rows of 8 footer bytes (7 UE8M0 scales, one per 64 NoPE values, then a zero byte);
  the same bytes as nvfp4_ds_mla (T = tokens per page);
- the pages: padded to a multiple of 576 (nvfp4_ds_mla: none): C4A and SWA 64 x 584 = 37,376 ->
  37,440 B; C128A 2 x 584 = 1,168 -> 1,728 B; the cache views keep (blocks, T, 584) rows with the
  padded page as the block stride, which the writers and FlashInfer take from stride(0).
"""

from __future__ import annotations

import ast
import inspect
import json
import sys
from pathlib import Path
from types import SimpleNamespace

# Run as a module from the repository (tests.overlay.fp8_ds_mla_checks): its siblings import.
from tests.overlay.patched_checks import imported_from  # noqa: E402

BLOCK_SIZE = 256
TOKEN, DATA, FOOTER = 584, 576, 8  # bytes a token, its data row, its footer row
NOPE, ROPE, TILE = 448, 64, 64
PAGES = {4: (64, 37440), 128: (2, 1728)}  # compress ratio -> (tokens a page, padded page bytes)
SWA_PAGE = (64, 37440)
NB = 3


def _attention_layer(cache_dtype: str, ratio: int):
    """The SM120 attention class's own instance, only the fields get_kv_cache_spec reads."""
    import torch
    from vllm.models.deepseek_v4 import attention as attn_mod
    from vllm.models.deepseek_v4.nvidia.flashinfer_sparse import (
        DeepseekV4FlashInferSM120Attention as A,
    )

    layer = object.__new__(A)
    torch.nn.Module.__init__(layer)
    layer.compress_ratio, layer.head_dim = ratio, 512
    layer.kv_cache_dtype, layer.kv_cache_torch_dtype = attn_mod._resolve_dsv4_kv_cache_dtype(
        A.use_fp8_ds_mla_layout, cache_dtype, None)
    return layer


def _swa_layer(cache_dtype: str):
    """The SWA cache layer through its own __init__, called as DeepseekV4Attention.__init__ calls it
    (no vLLM config is built: only its static_forward_context is read)."""
    import torch
    from vllm.models.deepseek_v4.nvidia.flashinfer_sparse import (
        DeepseekV4FlashInferSM120Attention as A,
    )
    from vllm.v1.attention.backends.mla import sparse_swa

    ctx = SimpleNamespace(compilation_config=SimpleNamespace(static_forward_context={}))
    saved = sparse_swa.get_current_vllm_config
    sparse_swa.get_current_vllm_config = lambda: ctx
    try:
        return sparse_swa.DeepseekV4SWACache(
            head_dim=512, window_size=128, dtype=torch.uint8, prefix="swa",
            cache_config=SimpleNamespace(cache_dtype=cache_dtype, block_size=BLOCK_SIZE),
            backend_cls=A.swa_backend_cls)
    finally:
        sparse_swa.get_current_vllm_config = saved


def _bound(layer, spec):
    """NB blocks of the layer's cache as 0.32.0 views it (LBHNC, one layer), bound to the layer."""
    import torch
    from vllm.v1.kv_cache_interface import KVCacheTensor, create_kv_cache_views
    from vllm.v1.kv_cache_layout import KVCacheLayout

    page = spec.page_size_bytes
    raw = torch.zeros(NB * page, dtype=torch.uint8)
    tensor = KVCacheTensor(size=NB * page, layers=["l"], layer_stride=NB * page, block_stride=page)
    (view,) = create_kv_cache_views(raw, spec, NB, KVCacheLayout.LBHNC, tensor)
    layer.bind_kv_cache(view)
    return raw


def _swa_call_keywords() -> set[str]:
    """The keywords DeepseekV4Attention.__init__ passes to DeepseekV4SWACache."""
    from vllm.models.deepseek_v4.attention import DeepseekV4Attention

    tree = ast.parse(inspect.getsource(DeepseekV4Attention.__init__).lstrip())
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)
             and getattr(n.func, "id", None) == "DeepseekV4SWACache"]
    assert len(calls) == 1, len(calls)
    return {k.arg for k in calls[0].keywords}


def check_imports(site: Path) -> None:
    import vllm

    assert vllm.__version__.split("+")[0] == "0.32.0", vllm.__version__
    imported_from(site, ("vllm.models.deepseek_v4.attention",
                         "vllm.models.deepseek_v4.nvidia.flashinfer_sparse",
                         "vllm.v1.attention.backends.mla.sparse_swa",
                         "vllm.v1.kv_cache_interface"))


def check_fp8_ds_mla_layout(site: Path) -> None:
    """The SM120 class resolves every fp8 spelling to fp8_ds_mla and refuses nvfp4_ds_mla (upstream's
    SM100 352-byte format by that name); its compressed caches (C4A, C128A at block 256) and its SWA
    cache (64-token blocks) are 584-byte tokens in pages padded to 576, shaped (blocks, 1, T, 584)
    from the spec and bound as (blocks, T, 584) with the padded page as the block stride; the SM120
    backend's fixed 256-token kernel block adds no block-stride alignment at block 256."""
    import torch
    from vllm.models.deepseek_v4 import attention as attn_mod
    from vllm.models.deepseek_v4.nvidia.flashinfer_sparse import (
        DeepseekV4FlashInferMLASparseBackend as B,
    )
    from vllm.models.deepseek_v4.nvidia.flashinfer_sparse import (
        DeepseekV4FlashInferSM120Attention as A,
    )
    from vllm.platforms.interface import DeviceCapability
    from vllm.v1.attention.backend import MultipleOf
    from vllm.v1.attention.backends.mla.sparse_swa import DeepseekV4SWACache
    from vllm.v1.kv_cache_interface import (
        KVQuantMode,
        MLAAttentionSpec,
        SlidingWindowMLASpec,
        compute_layer_kv_cache_shape_bytes,
    )
    from vllm.v1.worker.utils import customize_attention_spec

    # The dtype: every fp8 spelling (and auto) becomes fp8_ds_mla, written back to the cache config.
    assert A.use_fp8_ds_mla_layout is True
    for given in ("fp8", "fp8_e4m3", "fp8_ds_mla", "auto"):
        cfg = SimpleNamespace(cache_dtype=given)
        assert attn_mod._resolve_dsv4_kv_cache_dtype(True, given, cfg) == ("fp8_ds_mla", torch.uint8)
        assert cfg.cache_dtype == ("fp8_ds_mla" if given != "fp8_ds_mla" else given)
    try:
        attn_mod._resolve_dsv4_kv_cache_dtype(True, "nvfp4_ds_mla", None)
    except ValueError:
        pass
    else:
        raise AssertionError("nvfp4_ds_mla accepted by the fp8_ds_mla layout")
    args = dict(head_size=512, dtype=None, block_size=256, use_mla=True, has_sink=True,
                use_sparse=True, use_mm_prefix=False)
    assert "nvfp4_ds_mla" not in B.supported_kv_cache_dtypes
    assert B.supports_combination(kv_cache_dtype="nvfp4_ds_mla", device_capability=DeviceCapability(12, 1),
                                  **args) == "kv_cache_dtype not supported"
    assert B.get_supported_kernel_block_sizes() == [256]

    config = SimpleNamespace(cache_config=SimpleNamespace(block_size=BLOCK_SIZE))
    for ratio, (tokens, page) in PAGES.items():
        layer = _attention_layer("fp8_ds_mla", ratio)
        spec = layer.get_kv_cache_spec(config)
        assert type(spec) is MLAAttentionSpec, type(spec)
        assert (spec.block_size, spec.tokens_per_state, spec.num_states) == (BLOCK_SIZE, ratio, tokens), spec
        assert (spec.dtype, spec.cache_dtype_str, spec.kv_quant_mode) == (
            torch.uint8, "fp8_ds_mla", KVQuantMode.FP8_PER_TENSOR), spec
        assert (spec.state_content_bytes, spec.alignment) == (TOKEN, 576), spec
        assert spec.real_page_size_bytes == tokens * TOKEN  # 37,376 / 1,168: nvfp4_ds_mla's page
        assert spec.page_size_padded == spec.page_size_bytes == page == -(-tokens * TOKEN // 576) * 576
        # What the model runner publishes (attn_utils.get_kv_cache_spec -> customize_attention_spec).
        custom = customize_attention_spec(A.backend_cls, spec)
        assert custom.block_stride_alignment == MultipleOf(256), custom.block_stride_alignment
        assert custom.get_block_stride_alignment() == 1 and custom.page_size_bytes == page
        assert compute_layer_kv_cache_shape_bytes(custom, 10) == (10, 1, tokens, TOKEN)
        raw = _bound(layer, custom)
        cache = layer.kv_cache
        assert tuple(cache.shape) == (NB, tokens, TOKEN) and cache.stride() == (page, TOKEN, 1), (
            tuple(cache.shape), cache.stride())
        assert cache.data_ptr() == raw.data_ptr()
        paged = A._as_sparse_cache(cache)  # what FlashInfer's SM120 kernels receive
        assert tuple(paged.shape) == (NB, tokens, 1, TOKEN) and paged.stride(0) == page
        assert page % 16 == 0  # cp.async.bulk: block strides a multiple of 16 bytes

    # SWA: the class builds its SWA cache with the layer's defaults (64-token blocks, 584-byte
    # packed token, 576-byte page alignment).
    assert _swa_call_keywords() == {"head_dim", "window_size", "dtype", "prefix", "cache_config",
                                    "backend_cls"}
    defaults = inspect.signature(DeepseekV4SWACache.__init__).parameters
    assert (defaults["block_size"].default, defaults["packed_bytes_per_token"].default,
            defaults["packed_page_alignment"].default) == (64, TOKEN, 576)
    swa = _swa_layer("fp8_ds_mla")
    spec = swa.get_kv_cache_spec(None)
    tokens, page = SWA_PAGE
    assert type(spec) is SlidingWindowMLASpec, type(spec)
    assert (spec.block_size, spec.sliding_window, spec.state_content_bytes, spec.alignment) == (
        tokens, 128, TOKEN, 576), spec
    assert spec.real_page_size_bytes == tokens * TOKEN and spec.page_size_bytes == page
    custom = customize_attention_spec(swa.get_attn_backend(), spec)
    assert custom.block_stride_alignment is None and custom.get_block_stride_alignment() == 1
    assert compute_layer_kv_cache_shape_bytes(custom, 10) == (10, 1, tokens, TOKEN)
    _bound(swa, custom)
    assert tuple(swa.kv_cache.shape) == (NB, tokens, TOKEN) and swa.kv_cache.stride() == (page, TOKEN, 1)
    assert A._as_sparse_cache(swa.kv_cache).stride(0) == page


def _page_rows(raw, page: int, tokens: int, slot: int):
    """(data row, footer row) of a slot: page slot // T, data at t * 576, footer at T * 576 + t * 8."""
    base, t = (slot // tokens) * page, slot % tokens
    return (raw[base + t * DATA: base + (t + 1) * DATA],
            raw[base + tokens * DATA + t * FOOTER: base + tokens * DATA + (t + 1) * FOOTER])


def _dequant(data, footer):
    import torch

    vals = data[:NOPE].view(torch.float8_e4m3fn).float().view(NOPE // TILE, TILE)
    return (vals * torch.exp2(footer[:NOPE // TILE].float() - 127)[:, None]).reshape(NOPE)


def check_fp8_ds_mla_page_bytes(site: Path) -> None:
    """0.32.0's CPU DeepSeek V4 kernels (the CPU path's SWA insert and compressor store) write the
    token where the GPU writers and FlashInfer's SM120 kernels put it: in a page, T data rows of 576
    bytes ([0:448) e4m3 NoPE, [448:576) bf16 RoPE) then T footer rows of 8 bytes (7 UE8M0 scales =
    127 + ceil(log2(tile amax / 448)) for each 64-value NoPE tile, then 0); padding untouched."""
    import torch
    from vllm import _custom_ops as ops

    g = torch.Generator().manual_seed(0)
    # SWA: 64-token pages; rows 0 and 63 of pages 0 and 2.
    swa = _swa_layer("fp8_ds_mla")
    tokens, page = SWA_PAGE
    raw = _bound(swa, swa.get_kv_cache_spec(None))
    slots = torch.tensor([0, 63, 128, 191], dtype=torch.int64)
    n = slots.numel()
    kv = torch.randn(n, 512, generator=g) * (10 ** (torch.rand(n, 8, generator=g) * 3 - 1)).repeat_interleave(64, 1)
    kv = kv.to(torch.bfloat16)
    positions = torch.tensor([5, 900, 17, 4000], dtype=torch.int64)
    ang = torch.rand(4096, ROPE // 2, generator=g) * 6.283
    cos_sin = torch.cat([ang.cos(), ang.sin()], 1).float().contiguous()
    q = torch.randn(n, 8, 512, generator=g).to(torch.bfloat16)
    cache = swa.kv_cache
    ops.fused_qnorm_rope_kv_insert_cpu(q, kv, positions, cache.view(cache.shape[0], -1), slots, cos_sin,
                                       q.shape[1], 1e-6, swa.block_size)
    written = torch.zeros_like(raw, dtype=torch.bool)
    for i, slot in enumerate(slots.tolist()):
        data, footer = _page_rows(raw, page, tokens, slot)
        x = kv[i, :NOPE].float()
        amax = x.view(-1, TILE).abs().amax(1)
        assert footer.tolist() == [*(127 + torch.ceil(torch.log2(amax / 448))).int().tolist(), 0], footer
        err = (_dequant(data, footer) - x).abs().view(-1, TILE).amax(1)
        assert bool((err <= amax / 14).all()), (err / amax).max()  # e4m3: half a step of the top binade
        rot = kv[i, NOPE:].float().view(-1, 2)
        c, s = cos_sin[positions[i], :ROPE // 2], cos_sin[positions[i], ROPE // 2:]
        ref = torch.stack([rot[:, 0] * c - rot[:, 1] * s, rot[:, 0] * s + rot[:, 1] * c], 1).reshape(-1)
        rope = data[NOPE:].view(torch.bfloat16).float()
        assert torch.allclose(rope, ref, rtol=2 ** -7, atol=1e-6), (rope - ref).abs().max()
        for row in (data, footer):
            start = row.data_ptr() - raw.data_ptr()
            written[start: start + row.numel()] = True
    assert int(raw[~written].count_nonzero()) == 0  # other rows, other footers, the 64-byte padding

    # C128A: 2-token pages (footer at 1,152, 560 bytes of padding) through the CPU compressor; one
    # request of 256 tokens compresses to 2 tokens, into page 2's rows 0 and 1.
    from vllm.models.deepseek_v4.cpu.cpu_utils import map_local_to_global_slots_cpu

    ratio = 128
    tokens, page = PAGES[ratio]
    layer = _attention_layer("fp8_ds_mla", ratio)
    raw = _bound(layer, layer.get_kv_cache_spec(SimpleNamespace(cache_config=SimpleNamespace(block_size=BLOCK_SIZE))))
    state_bs, sw = 8, 512
    state = torch.randn(BLOCK_SIZE // state_bs, state_bs, 2 * sw, generator=g)
    positions = torch.arange(BLOCK_SIZE, dtype=torch.int64)
    boundary = (positions + 1) % ratio == 0
    kv_slots = torch.where(boundary, 2 * tokens + (positions + 1) // ratio - 1, torch.full_like(positions, -1))
    win = positions.unsqueeze(-1) - ratio + 1 + torch.arange(ratio)
    gather = map_local_to_global_slots_cpu(win, torch.zeros(BLOCK_SIZE, dtype=torch.int64),
                                           torch.arange(BLOCK_SIZE // state_bs, dtype=torch.int32)[None], state_bs)
    ops.compress_norm_rope_store_cpu(state, gather, positions, kv_slots, torch.ones(512), 1e-6, cos_sin,
                                     layer.kv_cache.view(NB, -1), tokens, ratio)
    assert int(raw[: 2 * page].count_nonzero()) == 0  # pages 0 and 1 untouched
    base = 2 * page
    assert int(raw[base + tokens * TOKEN: base + page].count_nonzero()) == 0  # the padding
    for t in range(tokens):
        data, footer = _page_rows(raw, page, tokens, 2 * tokens + t)
        assert footer[7] == 0 and bool((footer[:7] > 100).all()) and bool((footer[:7] < 140).all()), footer
        # RMSNorm with unit weight: the dequantised NoPE and the (rotated) RoPE hold the token's
        # 512 squares; a footer read from anywhere else would scale them by powers of two.
        ms = (_dequant(data, footer).square().sum() + data[NOPE:].view(torch.bfloat16).float().square().sum()) / 512
        assert abs(float(ms) - 1) < 0.03, float(ms)


CHECKS = {
    "imports": check_imports,
    "fp8_ds_mla_layout": check_fp8_ds_mla_layout,
    "fp8_ds_mla_page_bytes": check_fp8_ds_mla_page_bytes,
}


def main() -> None:
    from tests.overlay.tensor_checks import run_all

    print("@@RESULTS@@" + json.dumps(run_all(Path(sys.argv[1]), None, CHECKS)))


if __name__ == "__main__":
    main()
