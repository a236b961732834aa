"""MoE checks run inside a vLLM tree (patched or stock) in a subprocess, with the SM12x
platform simulated and the b12x stand-in (real signatures, real vocabularies) on the path.

``python moe_checks.py SITE STANDIN_DIR`` prints ``@@RESULTS@@{name: "ok" | traceback}``.
Each check drives vLLM's own code: Mxfp4MoEMethod (backend selection), create_weights,
weight loading through vLLM's scale loader, process_weights_after_loading (conversion,
quant config, modular kernel, the experts' weight preparation), and apply through
FusedMoEKernel (problem size, workspace manager, output allocation, finalize).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

E, K, N, TOPK, TOKENS = 8, 256, 128, 2, 5
SWIGLU_LIMIT = 10.0


@contextlib.contextmanager
def sm12x():
    """Simulate a CUDA capability-12.x device for vLLM's platform checks."""
    from vllm.platforms import current_platform

    cls = type(current_platform)
    saved = {n: cls.__dict__.get(n) for n in ("is_cuda", "is_device_capability_family")}
    cls.is_cuda = lambda self=None: True
    cls.is_device_capability_family = staticmethod(lambda family: family == 120)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                delattr(cls, name)
            else:
                setattr(cls, name, value)


def moe_config(**overrides):
    import torch
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.config import (
        FusedMoEConfig,
        FusedMoEParallelConfig,
        RoutingMethodType,
    )

    args = dict(
        num_experts=E, experts_per_token=TOPK, hidden_dim=K, intermediate_size=N,
        num_local_experts=E, num_logical_experts=E, activation=MoEActivation.SILU,
        device="cpu", routing_method=RoutingMethodType.DeepseekV4,
        moe_parallel_config=FusedMoEParallelConfig.make_no_parallel(),
        in_dtype=torch.bfloat16, moe_backend="flashinfer_b12x", max_num_tokens=64,
        swiglu_limit=SWIGLU_LIMIT, intermediate_size_per_partition=N,
    )
    args.update(overrides)
    return FusedMoEConfig(**args)


class Layer:
    """What Mxfp4MoEMethod reads from a RoutedExperts layer (a torch Module)."""

    def __new__(cls):
        import torch
        from vllm.model_executor.layers.fused_moe.activation import MoEActivation

        layer = torch.nn.Module()
        layer.activation = MoEActivation.SILU
        layer.swiglu_limit = SWIGLU_LIMIT
        layer.apply_router_weight_on_input = False
        layer.expert_map = None
        layer.global_num_experts = E
        layer._expert_routing_tables = lambda: None
        return layer


def checkpoint(seed: int = 0):
    """Per-expert checkpoint tensors: packed FP4 bytes and E8M0 scales as float powers of 2."""
    import torch

    g = torch.Generator().manual_seed(seed)
    ck = {}
    for e in range(E):
        for name, rows, cols in (("w1", N, K), ("w3", N, K), ("w2", K, N)):
            ck[(e, name, "weight")] = torch.randint(0, 256, (rows, cols // 2), generator=g, dtype=torch.uint8)
            exp = torch.randint(-4, 4, (rows, cols // 32), generator=g).float()
            ck[(e, name, "scale")] = torch.pow(2.0, exp)
    return ck


def load(layer, ck) -> None:
    """Load the checkpoint through the weight_loader attributes create_weights set."""
    for (e, name, kind), tensor in ck.items():
        param = layer.w2_weight if name == "w2" else layer.w13_weight
        if kind == "scale":
            param = layer.w2_weight_scale if name == "w2" else layer.w13_weight_scale
        param.weight_loader(param, tensor, f"experts.{e}.{name}.{kind}", name, e)


def plain_loader(param, loaded_weight, weight_name, shard_id, expert_id, return_success=False):
    rows = loaded_weight.shape[0]
    if shard_id == "w1":
        param.data[expert_id, :rows].copy_(loaded_weight)
    elif shard_id == "w3":
        param.data[expert_id, rows:2 * rows].copy_(loaded_weight)
    else:
        param.data[expert_id].copy_(loaded_weight)
    return True if return_success else None


def build_method(env: dict | None = None):
    import torch
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.quantization.mxfp4 import Mxfp4MoEMethod
    from vllm.v1.worker.workspace import init_workspace_manager, is_workspace_manager_initialized

    if not is_workspace_manager_initialized():
        init_workspace_manager(torch.device("cpu"))
    saved = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    try:
        with set_current_vllm_config(VllmConfig()), sm12x():
            method = Mxfp4MoEMethod(moe_config())
            layer = Layer()
            method.create_weights(layer, E, K, N, torch.bfloat16, weight_loader=plain_loader)
            load(layer, checkpoint())
            method.process_weights_after_loading(layer)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return method, layer


def run_apply(method, layer, tokens=TOKENS, ids_dtype=None):
    import torch
    from vllm.config import VllmConfig, set_current_vllm_config

    g = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, K, generator=g).to(torch.bfloat16)
    ids = torch.randint(0, E, (tokens, TOPK), generator=g, dtype=ids_dtype or torch.int32)
    weights = torch.rand(tokens, TOPK, generator=g)
    with set_current_vllm_config(VllmConfig()), sm12x():
        out = method.apply(layer, x, weights, ids, shared_experts=None, shared_experts_input=None)
    return x, ids, weights, out


def standin():
    import b12x_standin

    return b12x_standin


def check_selects_b12x(site: Path) -> None:
    from vllm.model_executor.layers.fused_moe.oracle import mxfp4

    with sm12x():
        backend, cls = mxfp4.select_deepseek_v4_mxfp4_moe_backend(moe_config())
    assert backend.name == "B12X_MXFP4", backend
    assert cls.__name__ == "B12xMxfp4Experts", cls
    # Off SM12x the backend is never selectable, even asked for by name.
    try:
        mxfp4.select_deepseek_v4_mxfp4_moe_backend(moe_config())
    except ValueError as e:
        assert "B12X" in str(e), e
    else:
        raise AssertionError("b12x MoE selected without an SM12x device")


def check_weight_path(site: Path) -> None:
    import torch

    s = standin()
    s.CALLS.clear()
    method, layer = build_method()
    calls = [c for c in s.CALLS if c[0] != "is_supported"]
    names = [c[0] for c in calls]
    assert names[:2] == ["plan_weights", "prepare_weights"], names
    wplan = dict(calls[0][1])
    assert (wplan["quant_modes"], wplan["source_format"], wplan["activation"]) == (
        "w4a16", "fp4_e8m0_k32", "silu"), wplan
    assert (wplan["num_experts"], wplan["hidden_size"], wplan["intermediate_size"]) == (E, K, N)
    assert wplan["params_dtype"] == torch.bfloat16
    # The checkpoint's bytes reached b12x: w13 rows are [gate (w1), up (w3)].
    ck = checkpoint()
    prep = dict(calls[1][1])
    assert torch.equal(prep["w1_fp4"][3, :N], ck[(3, "w1", "weight")])
    assert torch.equal(prep["w1_fp4"][3, N:], ck[(3, "w3", "weight")])
    assert torch.equal(prep["w2_fp4"][5], ck[(5, "w2", "weight")])
    # Scales went through vLLM's E8M0 encoding (2**x -> x + 127).
    want = (torch.log2(ck[(2, "w2", "scale")]) + 127).to(torch.uint8)
    assert torch.equal(prep["w2_blockscale"][2], want)
    # Source weights released once b12x holds its packed form.
    for name in ("w13_weight", "w2_weight", "w13_weight_scale", "w2_weight_scale"):
        assert getattr(layer, name).numel() == 0, name
    assert method.moe_kernel is not None


def check_apply_through_modular_kernel(site: Path) -> None:
    import torch

    s = standin()
    method, layer = build_method()
    for ids_dtype in (torch.int32, torch.int64):
        s.CALLS.clear()
        x, ids, weights, out = run_apply(method, layer, ids_dtype=ids_dtype)
        assert out.dtype == torch.bfloat16 and out.shape == (TOKENS, K), (out.dtype, out.shape)
        want = s.expected_output(x, ids.to(torch.int32), weights.float())
        torch.testing.assert_close(out, want)
        names = [c[0] for c in s.CALLS]
        assert "run" in names and "route" not in names, names
        binding = next(c[1] for c in s.CALLS if c[0] == "Plan.bind")
        assert binding["output"].dtype == torch.bfloat16
        assert binding["scratch"].dtype == torch.uint8
    # More tokens than any earlier call: the workspace grows, still no aliasing.
    x, ids, weights, out = run_apply(method, layer, tokens=37)
    torch.testing.assert_close(out, s.expected_output(x, ids, weights))


def check_force_a16(site: Path) -> None:
    s = standin()
    s.CALLS.clear()
    method, layer = build_method({"VLLM_B12X_MOE_FP4_FORCE_A16": "1"})
    run_apply(method, layer)
    wplan = next(c[1] for c in s.CALLS if c[0] == "plan_weights")
    assert wplan["quant_modes"] == "w4a16"
    caps = [c[1] for c in s.CALLS if c[0] == "Caps"]
    assert caps and all(c["quant_mode"] == "w4a16" for c in caps), caps


def check_nvfp4_a16_refused(site: Path) -> None:
    """NVFP4 experts + flashinfer_b12x + the A16 switch: a clear error naming it."""
    from vllm.model_executor.layers.fused_moe.oracle import nvfp4
    from vllm.model_executor.layers.quantization.utils.quant_utils import (
        kNvfp4Dynamic,
        kNvfp4Static,
    )

    os.environ["VLLM_B12X_MOE_FP4_FORCE_A16"] = "1"
    try:
        with sm12x():
            nvfp4.select_nvfp4_moe_backend(moe_config(swiglu_limit=None), kNvfp4Static, kNvfp4Dynamic)
    except ValueError as e:
        assert "VLLM_B12X_MOE_FP4_FORCE_A16" in str(e), e
    else:
        raise AssertionError("NVFP4 with the A16 switch was accepted")
    finally:
        del os.environ["VLLM_B12X_MOE_FP4_FORCE_A16"]


def check_small_m_override(site: Path) -> None:
    from vllm.utils import spark_sm12x as m

    off = m.read_small_m_override({m.B12X_FORCE_BLOCKS_PER_SM: "0"})
    assert not off.active and off.blocks_per_sm is None
    on = m.read_small_m_override({m.B12X_FORCE_BLOCKS_PER_SM: "2"})
    assert on.active and on.applies_to(16) and not on.applies_to(17)
    # The installer wraps b12x's W4A16 tile selector (its real keyword-only signature).
    import types

    import b12x_contract as contract

    sig = contract.function_signature("b12x.moe._shared.kernels.w4a16.kernel",
                                      "_select_tile_config")

    def select(*args, **kwargs):
        sig.bind(*args, **kwargs)
        return (128, 64, 128, 1)

    mod = types.SimpleNamespace(_select_tile_config=select)
    assert not m.install_small_m_override(mod, off) and mod._select_tile_config is select
    tiled = m.read_small_m_override({m.B12X_FORCE_BLOCKS_PER_SM: "3",
                                     m.B12X_FORCE_TILE_CONFIG: "256,32,256"})
    assert m.install_small_m_override(mod, tiled)
    assert m.install_small_m_override(mod, tiled)  # idempotent: wraps the original once
    args = dict(problem_n=2048, problem_k=4096, top_k=6, moe_block_size=16, sms=48,
                max_shared_mem=99 * 1024)
    assert mod._select_tile_config(problem_m=8, **args) == (256, 32, 256, 3)
    assert mod._select_tile_config(problem_m=17, **args) == (128, 64, 128, 1)
    assert mod._select_tile_config(problem_m=8, required_cta_threads=128, **args) == (128, 64, 128, 3)
    try:
        m.read_small_m_override({m.B12X_FORCE_BLOCKS_PER_SM: "-1"})
    except ValueError as e:
        assert m.B12X_FORCE_BLOCKS_PER_SM in str(e)
    else:
        raise AssertionError("-1 accepted")


def check_eager_modules(site: Path) -> None:
    from vllm.model_executor.layers.fused_moe.experts import b12x_mxfp4_moe as b

    s = standin()
    with sm12x():
        assert b.B12xMxfp4Experts._supports_current_device()
    missing = [name for name in b.B12X_MOE_MODULES if name not in s.IMPORTED]
    assert not missing, missing
    assert len(b.B12X_MOE_MODULES) > 1


def check_provider_warmup(site: Path) -> None:
    """vLLM's own b12x warm-up (kernel_warmup's b12x_warmup) reaches the MoE layers."""
    import torch
    from types import SimpleNamespace

    from vllm.model_executor.warmup.b12x_warmup import b12x_warmup

    s = standin()
    method, layer = build_method()
    method2, layer2 = build_method()  # a second layer of the same shape: warmed once
    model = torch.nn.Module()
    model.add_module("moe", layer)
    model.add_module("moe2", layer2)
    layer.quant_method, layer2.quant_method = method, method2
    worker = SimpleNamespace(
        get_model=lambda: model,
        scheduler_config=SimpleNamespace(max_num_batched_tokens=64),
        model_config=SimpleNamespace(dtype=torch.bfloat16),
    )
    s.CALLS.clear()
    with sm12x():
        b12x_warmup(worker, [1, 6, 24])
    names = [c[0] for c in s.CALLS]
    assert "route" not in names, names
    binds = [c[1]["a"].shape[0] for c in s.CALLS if c[0] == "Plan.bind"]
    assert sorted(binds) == [1, 6, 24, 64], binds
    assert names.count("run") == 4, names


CHECKS = {n[len("check_"):]: f for n, f in globals().items() if n.startswith("check_")}


def main() -> None:
    import torch

    # vLLM's workspace manager empties the accelerator cache when it grows a workspace;
    # a CPU-only torch has no accelerator to empty (a GPU run does this for real).
    if not torch.accelerator.is_available():
        torch.accelerator.empty_cache = lambda: None
    from tensor_checks import run_all

    print("@@RESULTS@@" + json.dumps(run_all(Path(sys.argv[1]), None, CHECKS)))


if __name__ == "__main__":
    main()
