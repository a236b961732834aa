"""Checks run inside a vLLM 0.29.0 tree patched with the v0.29.0 line's series
(overlay/lines/v0.29.0/series), in a subprocess of the line's own Python whose
PYTHONPATH puts the patched copy first. The same meaning as patched_checks.py's
checks of 0001, 0002, 0003 and 0007 on vLLM 0.28.0, written against 0.29.0's
API where it moved (a layer cache is shaped from its spec, ``tokens_per_state``
replaced ``compress_ratio``). Prints one JSON object: check name -> "ok" or the
failure's traceback. Run as ``python line029_checks.py PATCHED_SITE``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

# The 0.28.0 checks whose code holds unchanged on 0.29.0 (sys.path[0] is this folder).
import patched_checks  # noqa: E402
from patched_checks import (  # noqa: E402
    _with_family,
    check_cache_dtype,
    check_nvfp4_rewrite,
    check_tensor_logic,
    check_warmup_prompt_len,
    flashinfer_takes_nvfp4,
    imported_from,
    swa_cache_layer,
)

# The v0.29.0 series patches the modules the v0.28.0 series does, less the b12x MoE backend's
# (0004, 0005, 0006, 0009 and 0010 are upstream in 0.29.0).
PATCHED_MODULES = tuple(m for m in patched_checks.PATCHED_MODULES if m not in (
    "vllm.utils.b12x",
    "vllm.model_executor.layers.fused_moe.oracle.mxfp4",
    "vllm.model_executor.layers.fused_moe.experts.b12x_mxfp4_moe",
    "vllm.model_executor.warmup.b12x_warmup",
    "vllm.model_executor.layers.fused_moe.oracle.nvfp4",
    "vllm.model_executor.layers.quantization.mxfp4",
))


def check_imports(site: Path) -> None:
    import vllm

    assert vllm.__version__.split("+")[0] == "0.29.0", vllm.__version__
    imported_from(site, PATCHED_MODULES)


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


def check_page_size_specs(site: Path) -> None:
    """584-byte tokens in unpadded pages for the compressed MLA and SWA caches, through the
    patched layers' own get_kv_cache_spec; the shape vLLM 0.29.0 gives each layer's cache
    from its spec, and the SWA layer's bound view (blocks, tokens, 584)."""
    from types import SimpleNamespace

    import torch
    from vllm.v1.kv_cache_interface import compute_layer_kv_cache_shape_bytes

    config = SimpleNamespace(cache_config=SimpleNamespace(block_size=256))
    for ratio in (4, 128):
        layer = _attention_layer("nvfp4_ds_mla", ratio)
        assert (layer.kv_cache_dtype, layer.kv_cache_torch_dtype) == ("nvfp4_ds_mla", torch.uint8)
        spec = layer.get_kv_cache_spec(config)
        assert (spec.alignment, spec.dtype, spec.tokens_per_state) == (584, torch.uint8, ratio), spec
        assert spec.page_size_bytes == (256 // ratio) * 584, (ratio, spec.page_size_bytes)
        assert spec.page_size_padded is None
        assert compute_layer_kv_cache_shape_bytes(spec, 10) == (10, 1, 256 // ratio, 584)
        # fp8_ds_mla keeps 0.29.0's 576-byte padding.
        fp8 = _attention_layer("fp8_ds_mla", ratio).get_kv_cache_spec(config)
        assert fp8.alignment == 576 and fp8.page_size_bytes == -(-(256 // ratio) * 584 // 576) * 576
    swa = swa_cache_layer(64, "nvfp4_ds_mla")
    spec = swa.get_kv_cache_spec(None)
    assert (spec.page_size_bytes, spec.alignment, spec.page_size_padded) == (64 * 584, 584, None), spec
    shape = compute_layer_kv_cache_shape_bytes(spec, 10)
    assert shape == (10, 1, 64, 584), shape
    swa.bind_kv_cache(torch.zeros(shape, dtype=torch.uint8))
    assert tuple(swa.kv_cache.shape) == (10, 64, 584)
    swa.cache_config = SimpleNamespace(cache_dtype="fp8_ds_mla")
    fp8 = swa.get_kv_cache_spec(None)
    assert fp8.alignment == 576 and fp8.page_size_bytes == -(-64 * 584 // 576) * 576 != 64 * 584


def check_flashinfer_backend(site: Path) -> None:
    A = flashinfer_takes_nvfp4()
    # The port carries the per-request row plan and not the SWA width padding (inert with the
    # FlashInfer 0.6.18 vLLM 0.29.0 pins): the class plans rows on SM12x only.
    import vllm.utils.spark_sm12x_attn as m

    assert not hasattr(m, "pad_index_width") and not hasattr(m, "decode_index_width")
    md = _uniform_decode(reqs=2, q_len=5)
    src, keep = _with_family(120, lambda: A._sm12x_decode_rows(md, "cpu"))
    assert src.tolist() == [0, 1, 2, 3, 4, 4, 5, 6, 7, 8, 9, 9] and keep.tolist() == [0, 1, 2, 3, 4, 6, 7, 8, 9, 10]
    assert _with_family(None, lambda: A._sm12x_decode_rows(md, "cpu")) == (None, None)
    assert _with_family(120, lambda: A._sm12x_decode_rows(_uniform_decode(reqs=3, q_len=6), "cpu")) == (None, None)


def _uniform_decode(reqs: int, q_len: int):
    import torch
    from vllm.v1.attention.backends.mla.sparse_swa import DeepseekSparseSWAMetadata

    qsl = torch.arange(reqs + 1, dtype=torch.int32) * q_len
    return DeepseekSparseSWAMetadata(
        block_table=torch.zeros(reqs, 1, dtype=torch.int32), slot_mapping=torch.zeros(0),
        block_size=64, query_start_loc=qsl, query_start_loc_cpu=qsl, num_decodes=reqs,
        num_decode_tokens=reqs * q_len, max_decode_query_len=q_len)


CHECKS = {
    "imports": check_imports,
    "tensor_logic": check_tensor_logic,
    "cache_dtype": check_cache_dtype,
    "nvfp4_rewrite": check_nvfp4_rewrite,
    "page_size_specs": check_page_size_specs,
    "flashinfer_backend": check_flashinfer_backend,
    "warmup_prompt_len": check_warmup_prompt_len,
}


def main() -> None:
    from tensor_checks import run_all

    print("@@RESULTS@@" + json.dumps(run_all(Path(sys.argv[1]), None, CHECKS)))


if __name__ == "__main__":
    main()
