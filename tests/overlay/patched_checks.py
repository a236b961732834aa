"""Checks run inside a patched vLLM tree (a subprocess whose PYTHONPATH puts
the patched copy first). Prints one JSON object: check name -> "ok" or the
failure's traceback. Run as ``python patched_checks.py PATCHED_SITE``.
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

PATCHED_MODULES = (
    "vllm.utils.spark_sm12x",
    "vllm.utils.spark_sm12x_attn",
    "vllm.config.cache",
    "vllm.config.vllm",
    "vllm.utils.torch_utils",
    "vllm.utils.b12x",
    "vllm.models.deepseek_v4.attention",
    "vllm.models.deepseek_v4.compressor",
    "vllm.models.deepseek_v4.sparse_mla",
    "vllm.models.deepseek_v4.nvidia.flashinfer_sparse",
    "vllm.models.deepseek_v4.nvidia.model",
    "vllm.v1.attention.backends.mla.sparse_swa",
    "vllm.model_executor.layers.fused_moe.oracle.mxfp4",
    "vllm.model_executor.layers.fused_moe.experts.b12x_mxfp4_moe",
    "vllm.model_executor.warmup.kernel_warmup",
    "vllm.model_executor.warmup.b12x_warmup",
    "vllm.model_executor.layers.fused_moe.oracle.nvfp4",
    "vllm.model_executor.layers.quantization.mxfp4",
    "vllm.v1.worker.gpu.warmup",
)


class _Family:
    """Stands in for the GPU's capability family; no SM12x GPU runs here."""

    def __init__(self, family: int | None):
        self.family = family

    def __call__(self, family: int) -> bool:
        return family == self.family


def _with_family(family: int | None, fn):
    from vllm.platforms import current_platform

    cls = type(current_platform)
    saved = cls.__dict__.get("is_device_capability_family")
    cls.is_device_capability_family = staticmethod(_Family(family))
    try:
        return fn()
    finally:
        if saved is None:
            del cls.is_device_capability_family
        else:
            cls.is_device_capability_family = saved


def imported_from(site: Path, modules: tuple[str, ...]) -> None:
    """Every patched module imports, and from the patched copy, not the installed tree."""
    for name in modules:
        module = importlib.import_module(name)
        origin = Path(module.__file__).resolve()
        assert origin.is_relative_to(site.resolve()), f"{name} came from {origin}"


def check_imports(site: Path) -> None:
    imported_from(site, PATCHED_MODULES)


def check_tensor_logic(site: Path) -> None:
    import vllm.utils.spark_sm12x as m

    from tests.overlay.tensor_checks import run_all

    failed = {k: v for k, v in run_all(m, "cpu").items() if v != "ok"}
    assert not failed, "\n".join(failed.values())


def check_cache_dtype(site: Path) -> None:
    import torch
    from vllm.config.cache import CacheConfig
    from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE, is_quantized_kv_cache
    from vllm.v1.kv_cache_interface import KVQuantMode, get_kv_quant_mode

    assert CacheConfig(cache_dtype="nvfp4_ds_mla").cache_dtype == "nvfp4_ds_mla"
    assert STR_DTYPE_TO_TORCH_DTYPE["nvfp4_ds_mla"] is torch.uint8
    assert is_quantized_kv_cache("nvfp4_ds_mla")
    assert get_kv_quant_mode("nvfp4_ds_mla") is KVQuantMode.NVFP4


def check_nvfp4_rewrite(site: Path) -> None:
    from types import SimpleNamespace

    from vllm.config.vllm import VllmConfig

    def validate(model_type: str, use_mla: bool, dtype: str) -> str:
        cfg = SimpleNamespace(
            model_config=SimpleNamespace(
                use_mla=use_mla, hf_text_config=SimpleNamespace(model_type=model_type)
            ),
            cache_config=SimpleNamespace(cache_dtype=dtype),
        )
        VllmConfig.validate_nvfp4_kv_cache_with_mla(cfg)
        return cfg.cache_config.cache_dtype

    assert validate("deepseek_v4", True, "nvfp4") == "nvfp4_ds_mla"
    assert validate("deepseek_v4", True, "nvfp4_ds_mla") == "nvfp4_ds_mla"
    assert validate("deepseek_v4", True, "fp8") == "fp8"
    assert validate("llama", False, "nvfp4") == "nvfp4"
    for model_type, dtype in (("deepseek_v3", "nvfp4"), ("deepseek_v3", "nvfp4_ds_mla")):
        try:
            validate(model_type, True, dtype)
        except ValueError:
            continue
        raise AssertionError(f"{model_type} {dtype} was accepted")


def check_page_size_specs(site: Path) -> None:
    import torch
    from vllm.models.deepseek_v4.sparse_mla import DeepseekV4SparseMLABackend
    from vllm.utils.spark_sm12x import ds_mla_alignment
    from vllm.v1.kv_cache_interface import (
        MLAAttentionSpec,
        SlidingWindowMLASpec,
        get_kv_quant_mode,
    )

    for ratio in (4, 128):
        spec = MLAAttentionSpec(
            block_size=256, num_kv_heads=1, head_size=512, dtype=torch.uint8,
            compress_ratio=ratio, cache_dtype_str="nvfp4_ds_mla",
            alignment=ds_mla_alignment("nvfp4_ds_mla"), model_version="deepseek_v4",
            kv_quant_mode=get_kv_quant_mode("nvfp4_ds_mla"), state_content_bytes=584,
        )
        assert spec.page_size_bytes == (256 // ratio) * 584, (ratio, spec.page_size_bytes)
    swa = SlidingWindowMLASpec(
        block_size=256, num_kv_heads=1, head_size=512, dtype=torch.uint8,
        sliding_window=128, cache_dtype_str="nvfp4_ds_mla", state_content_bytes=584,
        alignment=584, model_version="deepseek_v4",
    )
    assert swa.page_size_bytes == 256 * 584
    # fp8_ds_mla keeps v0.28.0's 576-byte padding: 256 * 584 rounded up.
    fp8 = SlidingWindowMLASpec(
        block_size=256, num_kv_heads=1, head_size=512, dtype=torch.uint8,
        sliding_window=128, cache_dtype_str="fp8_ds_mla", state_content_bytes=584,
        alignment=576, model_version="deepseek_v4",
    )
    assert fp8.page_size_bytes == -(-256 * 584 // 576) * 576 != 256 * 584
    for dtype in ("nvfp4_ds_mla", "fp8_ds_mla"):
        assert DeepseekV4SparseMLABackend.get_kv_cache_shape(10, 64, 1, 512, dtype) == (
            10, 64, 584,
        )
    assert DeepseekV4SparseMLABackend.get_kv_cache_shape(10, 64, 1, 512, "auto") == (
        10, 64, 512,
    )
    # The SWA cache layer's own spec (the patched code path).
    spec = swa_cache_layer(256, "nvfp4_ds_mla").get_kv_cache_spec(None)
    assert (spec.page_size_bytes, spec.alignment) == (256 * 584, 584), spec
    assert swa_cache_layer(256, "fp8_ds_mla").get_kv_cache_spec(None).alignment == 576


def swa_cache_layer(block_size: int, cache_dtype: str):
    """vLLM's own SWA cache layer, only the fields its get_kv_cache_spec reads (no model built)."""
    from types import SimpleNamespace

    import torch
    from vllm.v1.attention.backends.mla.sparse_swa import DeepseekV4SWACache

    layer = object.__new__(DeepseekV4SWACache)
    torch.nn.Module.__init__(layer)
    layer.block_size, layer.head_dim, layer.window_size = block_size, 512, 128
    layer.dtype = torch.uint8
    layer.cache_config = SimpleNamespace(cache_dtype=cache_dtype)
    return layer


def flashinfer_takes_nvfp4():
    """The SM120 FlashInfer backend lists nvfp4_ds_mla, refuses it on SM10x and takes it on
    SM121; the head ladder is stock (TP=2: 32 heads per rank stay 32). Returns the attention
    class for the line's own checks."""
    from vllm.models.deepseek_v4.nvidia.flashinfer_sparse import (
        DeepseekV4FlashInferMLASparseBackend as B,
    )
    from vllm.models.deepseek_v4.nvidia.flashinfer_sparse import (
        DeepseekV4FlashInferSM120Attention as A,
    )
    from vllm.platforms.interface import DeviceCapability

    assert "nvfp4_ds_mla" in B.supported_kv_cache_dtypes
    args = dict(head_size=512, dtype=None, block_size=256, use_mla=True, has_sink=True,
                use_sparse=True, use_mm_prefix=False)
    sm100 = B.supports_combination(
        kv_cache_dtype="nvfp4_ds_mla", device_capability=DeviceCapability(10, 0), **args
    )
    assert sm100 is not None  # refused on SM10x
    sm121 = B.supports_combination(
        kv_cache_dtype="nvfp4_ds_mla", device_capability=DeviceCapability(12, 1), **args
    )
    # Accepted dtype; FlashInfer itself is not installed here.
    assert sm121 is None or "kv_cache_dtype" not in sm121, sm121
    assert [A.get_padded_num_q_heads(h) for h in (8, 16, 32, 64)] == [8, 16, 32, 64]
    return A


def check_flashinfer_backend(site: Path) -> None:
    flashinfer_takes_nvfp4()
    # Index widths the SM120 class pads to (kv_layout_checks runs the class
    # itself through vLLM's packing; this is the width rule alone).
    from vllm.utils.spark_sm12x_attn import Sm12xIndexWidthError, decode_index_width

    assert [decode_index_width(w, (128, 512, 1024)) for w in (128, 192, 512)] == [
        128, 512, 512]
    try:
        decode_index_width(1025, (128, 512, 1024))
    except Sm12xIndexWidthError as e:
        assert "1025" in str(e) and "1024" in str(e)
    else:
        raise AssertionError("width 1025 accepted")


def check_b12x_backend(site: Path) -> None:
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.config import RoutingMethodType
    from vllm.model_executor.layers.fused_moe.experts.b12x_mxfp4_moe import (
        B12xMxfp4Experts as E,
    )
    from vllm.model_executor.layers.fused_moe.experts.b12x_mxfp4_moe import (
        b12x_fused_moe_api,
    )
    from vllm.model_executor.layers.fused_moe.oracle import mxfp4
    from vllm.model_executor.layers.quantization.utils.quant_utils import (
        kMxfp4Static,
        kNvfp4Static,
    )

    assert mxfp4.map_mxfp4_backend("flashinfer_b12x") == [mxfp4.Mxfp4MoeBackend.B12X_MXFP4]
    assert mxfp4.backend_to_kernel_cls(mxfp4.Mxfp4MoeBackend.B12X_MXFP4) == [E]
    # b12x is not installed here: the backend must not be selectable.
    assert b12x_fused_moe_api() is None
    assert not E._supports_current_device()
    assert not _with_family(120, E._supports_current_device)
    assert E._supports_quant_scheme(kMxfp4Static, None)
    assert not E._supports_quant_scheme(kNvfp4Static, None)
    assert E._supports_activation(MoEActivation.SILU)
    # b12x has no interleaved (gpt-oss) SwiGLU-OAI; DeepSeek V4 is SiLU with a clamp.
    assert not E._supports_activation(MoEActivation.SWIGLUOAI)
    assert not E._supports_activation(MoEActivation.GELU)
    assert E._supports_routing_method(RoutingMethodType.DeepseekV4, kMxfp4Static, None)
    assert not E._supports_routing_method(RoutingMethodType.Renormalize, kMxfp4Static, None)


def check_b12x_env(site: Path) -> None:
    from vllm.utils import spark_sm12x as m

    assert not m.read_small_m_override({}).active
    assert m.read_small_m_override({}).max_m == 16
    o = m.read_small_m_override({
        m.B12X_FORCE_BLOCKS_PER_SM: "2", m.B12X_FORCE_TILE_CONFIG: "128, 64, 256",
    })
    assert (o.blocks_per_sm, o.max_m, o.tile_k, o.tile_n, o.cta_threads) == (2, 16, 128, 64, 256)
    assert o.applies_to(16) and not o.applies_to(17)
    for bad in ({m.B12X_FORCE_TILE_CONFIG: "128,64"}, {m.B12X_FORCE_BLOCKS_MAX_M: "0"},
                {m.B12X_FORCE_BLOCKS_PER_SM: "x"}, {m.B12X_FORCE_BLOCKS_PER_SM: "-1"}):
        try:
            m.read_small_m_override(bad)
        except ValueError:
            continue
        raise AssertionError(f"{bad} accepted")
    assert m.read_force_a16({m.B12X_FORCE_A16: "1"}) and not m.read_force_a16({})
    # Off capture (always, on CPU) the guard is silent.
    m.refuse_during_capture("test")


def check_out_op_optional(site: Path) -> None:
    import torch
    from vllm.models.deepseek_v4 import attention
    from vllm.utils.spark_sm12x import optional_op, use_eager_scratch_pool

    registered = hasattr(torch.ops._C, attention.QNORM_INSERT_OUT_OP)
    op = attention.qnorm_insert_out_op()  # must not raise either way
    assert (op is not None) == registered
    assert optional_op(torch.ops._C, "dspark_no_such_op_out") is None
    assert optional_op(torch.ops.aten, "add") is torch.ops.aten.add
    assert use_eager_scratch_pool(sm12x=False, use_ubatching=False)
    assert not use_eager_scratch_pool(sm12x=True, use_ubatching=False)
    assert not use_eager_scratch_pool(sm12x=False, use_ubatching=True)


def check_warmup_prompt_len(site: Path) -> None:
    from vllm.v1.worker.gpu import warmup

    assert [warmup.warmup_prompt_len(q) for q in (1, 6, 4)] == [2, 7, 5]  # CPU: stock
    assert _with_family(None, lambda: warmup.warmup_prompt_len(1)) == 2
    assert _with_family(120, lambda: warmup.warmup_prompt_len(1)) == 6
    assert _with_family(120, lambda: warmup.warmup_prompt_len(6)) == 8


CHECKS = {name[len("check_"):]: fn for name, fn in globals().items()
          if name.startswith("check_")}


def main() -> None:
    from tests.overlay.tensor_checks import run_all

    print("@@RESULTS@@" + json.dumps(run_all(Path(sys.argv[1]), None, CHECKS)))


if __name__ == "__main__":
    main()
