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
    from tests.overlay import b12x_standin

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
    # The checkpoint's bytes reached b12x: w13 rows are [gate (w1), up (w3)] (FP4 -0
    # nibbles written as +0 on SM12x: the same values, see check_fp4_negative_zero).
    ck = checkpoint()
    prep = dict(calls[1][1])
    assert torch.equal(prep["w1_fp4"][3, :N], positive_zero(ck[(3, "w1", "weight")]))
    assert torch.equal(prep["w1_fp4"][3, N:], positive_zero(ck[(3, "w3", "weight")]))
    assert torch.equal(prep["w2_fp4"][5], positive_zero(ck[(5, "w2", "weight")]))
    # Scales went through vLLM's E8M0 encoding (2**x -> x + 127).
    want = (torch.log2(ck[(2, "w2", "scale")]) + 127).to(torch.uint8)
    assert torch.equal(prep["w2_blockscale"][2], want)
    # Source weights released once b12x holds its packed form.
    for name in ("w13_weight", "w2_weight", "w13_weight_scale", "w2_weight_scale"):
        assert getattr(layer, name).numel() == 0, name
    assert method.moe_kernel is not None


# FP4 E2M1 code -> value (OCP MX): sign bit 3, then 0, 0.5, 1, 1.5, 2, 3, 4, 6.
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def nibbles(packed):
    import torch

    return torch.stack((packed & 0x0F, packed >> 4), dim=-1)


def fp4_values(packed):
    import torch

    n = nibbles(packed).long()
    mag = torch.tensor(E2M1)[n & 7]
    return torch.where(n >= 8, -mag, mag)


def positive_zero(packed):
    """The test's own rewrite: nibble 8 (-0) -> 0, every other nibble kept."""
    n = nibbles(packed)
    n = n.masked_fill(n == 8, 0)
    return n[..., 0] | (n[..., 1] << 4)


def check_fp4_negative_zero(site: Path) -> None:
    """FP4 negative-zero nibbles (0b1000) are written as +0 before b12x prepares the
    weights (the v0.28.0 line and upstream's b12x backend both do it), through vLLM's
    loading and process_weights_after_loading; every value stays the same."""
    import torch

    s = standin()
    s.CALLS.clear()
    build_method()
    prep = next(c[1] for c in s.CALLS if c[0] == "prepare_weights")
    ck = checkpoint()
    w13 = torch.stack([torch.cat((ck[(e, "w1", "weight")], ck[(e, "w3", "weight")])) for e in range(E)])
    w2 = torch.stack([ck[(e, "w2", "weight")] for e in range(E)])
    for name, source in (("w1_fp4", w13), ("w2_fp4", w2)):
        assert int((nibbles(source) == 8).sum()) > 0, "the checkpoint holds no -0 to rewrite"
        got = prep[name]
        assert int((nibbles(got) == 8).sum()) == 0, f"{name}: -0 nibbles reached b12x"
        assert torch.equal(got, positive_zero(source)), name
        assert torch.equal(fp4_values(got), fp4_values(source)), f"{name}: a value changed"


def check_topk_sentinels(site: Path) -> None:
    """-1 top-k ids (vLLM's top-k kernels write them for CUDA-graph padding rows with
    VLLM_MOE_SKIP_PADDING, on by default) reach b12x as expert 0 with weight 0, through
    Mxfp4MoEMethod.apply and FusedMoEKernel; the real rows' output is unchanged."""
    import torch
    from vllm.config import VllmConfig, set_current_vllm_config

    s = standin()
    method, layer = build_method()
    g = torch.Generator().manual_seed(3)
    tokens = 24  # above the 16-row minimum: the launch is not padded
    x = torch.randn(tokens, K, generator=g).to(torch.bfloat16)
    ids = torch.randint(0, E, (tokens, TOPK), generator=g, dtype=torch.int32)
    weights = torch.rand(tokens, TOPK, generator=g)
    ids[20:] = -1  # four graph-padding rows
    ids[3, 1] = -1
    s.CALLS.clear()
    with set_current_vllm_config(VllmConfig()), sm12x():
        out = method.apply(layer, x, weights, ids, shared_experts=None, shared_experts_input=None)
    bind = next(c[1] for c in s.CALLS if c[0] == "Plan.bind")
    assert int((bind["topk_ids"] < 0).sum()) == 0, "a -1 expert id reached b12x"
    dropped = ids < 0
    assert torch.equal(bind["topk_ids"], ids.masked_fill(dropped, 0))
    assert torch.equal(bind["topk_weights"], weights.masked_fill(dropped, 0.0))
    want = s.expected_output(x, ids.masked_fill(dropped, 0), weights.masked_fill(dropped, 0.0))
    torch.testing.assert_close(out, want)
    assert ids[3, 1] == -1 and weights[3, 1] != 0  # the caller's tensors are untouched


def check_min_tokens_pad(site: Path) -> None:
    """On SM12x every b12x MoE launch has at least 16 token rows (the v0.28.0 line's pad:
    8-row launches faulted on GB10): b12x plans and binds 16 rows for 1..15 tokens, through
    FusedMoEKernel's workspace and output; the real rows' output is exact."""
    import torch

    s = standin()
    method, layer = build_method()
    for tokens in (1, 5, 15, 16, 37):
        s.CALLS.clear()
        x, ids, weights, out = run_apply(method, layer, tokens=tokens)
        binds = [c[1] for c in s.CALLS if c[0] == "Plan.bind"]
        assert [b["a"].shape[0] for b in binds] == [max(tokens, 16)], (tokens, binds)
        b = binds[0]
        assert b["plan"].caps.max_tokens == max(tokens, 16) if "plan" in b else True
        assert out.shape == (tokens, K)
        torch.testing.assert_close(out, s.expected_output(x, ids, weights))
        if tokens < 16:
            assert int(b["topk_weights"][tokens:].abs().sum()) == 0, "pad rows weigh"
    caps = sorted({c[1]["max_tokens"] for c in s.CALLS if c[0] == "Caps"} |
                  {p.caps.max_tokens for p in method.moe_kernel.fused_experts._plans.values()})
    assert min(caps) >= 16, caps


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


def _tiles(s) -> dict[str, tuple]:
    return {c[1]["stage"]: tuple(c[1]["tile"]) for c in s.CALLS if c[0] == "select_tile_config"}


def check_small_m_override(site: Path) -> None:
    """VLLM_B12X_W4A16_FORCE_TILE_CONFIG reaches b12x's W4A16 tile selection (b12x's own
    _select_tile_config, _candidate_tile_fits and _determine_blocks_per_sm, run from the
    pinned sources by the stand-in at every launch) through vLLM's path: set in the
    environment, read through vllm.envs at backend construction, installed after weight
    preparation. A tile b12x's fit check refuses keeps b12x's choice; a forced blocks-per-SM
    figure (no b12x path takes one) is refused, 0 (off) is accepted."""
    import sys

    from vllm.utils import spark_sm12x as m

    s = standin()
    kernel = sys.modules["b12x.moe._shared.kernels.w4a16.kernel"]
    own = kernel._select_tile_config
    try:
        method, layer = build_method()
        s.CALLS.clear()
        run_apply(method, layer)
        stock = _tiles(s)
        assert stock["fc1"][:3] == stock["fc2"][:3] == (128, 128, 256), stock
        s.CALLS.clear()
        run_apply(method, layer, tokens=37)
        stock37 = _tiles(s)
        s.CALLS.clear()
        run_apply(method, layer, tokens=4)
        stock4 = _tiles(s)
        # b12x asks FC1 with the launch's rows and FC2 with rows x top-k (2 here); a 5-token
        # launch runs 16 rows on SM12x: FC1 16, FC2 32, both at most FORCE_BLOCKS_MAX_M=64.
        env = {m.B12X_FORCE_TILE_CONFIG: "64,128,128", m.B12X_FORCE_BLOCKS_PER_SM: "0",
               m.B12X_FORCE_BLOCKS_MAX_M: "64"}
        method, layer = build_method(env)
        s.CALLS.clear()
        run_apply(method, layer)
        forced = _tiles(s)
        assert forced["fc1"][:3] == forced["fc2"][:3] == (64, 128, 128), forced
        assert all(t[3] >= 1 for t in forced.values()), forced
        s.CALLS.clear()
        run_apply(method, layer, tokens=37)  # FC1 37 (forced), FC2 74 (above 64: b12x's)
        got = _tiles(s)
        assert got["fc1"][:3] == (64, 128, 128) and got["fc2"] == stock37["fc2"], (got, stock37)
        # MAX_M read through vllm.envs: 4 tokens is above a limit of 3.
        method, layer = build_method({**env, m.B12X_FORCE_BLOCKS_MAX_M: "3"})
        s.CALLS.clear()
        run_apply(method, layer, tokens=4)
        assert _tiles(s) == stock4 and stock4["fc1"][:3] != (64, 128, 128), (_tiles(s), stock4)
        # N=256 is no multiple of tile_n 512: b12x's fit check refuses it, its tile stays.
        method, layer = build_method({m.B12X_FORCE_TILE_CONFIG: "128,512,256"})
        s.CALLS.clear()
        run_apply(method, layer)
        assert _tiles(s) == stock, (_tiles(s), stock)
        # The public GB10 recipes' line: blocks 0, max M 16, tile empty: all off.
        method, layer = build_method({m.B12X_FORCE_BLOCKS_PER_SM: "0",
                                      m.B12X_FORCE_BLOCKS_MAX_M: "16",
                                      m.B12X_FORCE_TILE_CONFIG: ""})
        assert not method.moe_kernel.fused_experts.small_m.active
        try:
            build_method({m.B12X_FORCE_BLOCKS_PER_SM: "2"})
        except ValueError as e:
            assert m.B12X_FORCE_BLOCKS_PER_SM in str(e), e
        else:
            raise AssertionError("a forced blocks-per-SM figure was accepted")
    finally:
        kernel._select_tile_config = getattr(own, "__dspark_original__", own)


OVERLAY_ENV_VALUES = {
    "VLLM_B12X_MOE_FP4_FORCE_A16": ("1", True),
    "VLLM_B12X_W4A16_FORCE_BLOCKS_PER_SM": ("0", 0),
    "VLLM_B12X_W4A16_FORCE_BLOCKS_MAX_M": ("8", 8),
    "VLLM_B12X_W4A16_FORCE_TILE_CONFIG": ("64,128,128", "64,128,128"),
    "VLLM_SHM_BROADCAST_BUSY_LOOP_S": ("0.5", 0.5),  # 0013
}


def overlay_env_names() -> list[str]:
    """Every VLLM_* name the overlay's patches add (their + lines)."""
    import re

    overlay = Path(__file__).resolve().parents[2] / "overlay"
    names = set()
    for patch in sorted(overlay.glob("*.patch")):
        for line in patch.read_text().splitlines():
            if line.startswith("+") and not line.startswith("+++"):
                names.update(re.findall(r"\bVLLM_[A-Z0-9_]+", line))
    return sorted(names)


def check_env_registered(site: Path) -> None:
    """Each variable the overlay reads, set alone, passes vLLM's own environment validation
    (envs.validate_environ, as EngineArgs.create_engine_config calls it with
    --fail-on-environ-validation parsed by vLLM's own CLI parser: unknown VLLM_* names are
    an error there, a warning otherwise) and reads back typed through vllm.envs."""
    import logging

    from vllm import envs
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    names = overlay_env_names()
    assert set(OVERLAY_ENV_VALUES) <= set(names), names
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    args = EngineArgs.from_cli_args(parser.parse_args(["--fail-on-environ-validation"]))
    assert args.fail_on_environ_validation is True
    warnings: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger(envs.__name__).addHandler(handler)
    failures = []
    try:
        for name in names:
            # A name the patches only mention (one vLLM itself reads) is validated alone.
            raw, typed = OVERLAY_ENV_VALUES.get(name, ("1", None))
            os.environ[name] = raw
            try:
                envs.validate_environ(False)
                try:
                    envs.validate_environ(args.fail_on_environ_validation)
                except ValueError as e:
                    failures.append(str(e))
                    continue
                if name in OVERLAY_ENV_VALUES:
                    assert getattr(envs, name) == typed, (name, getattr(envs, name))
            finally:
                del os.environ[name]
    finally:
        logging.getLogger(envs.__name__).removeHandler(handler)
    unknown = [w for w in warnings if "Unknown vLLM environment variable" in w]
    assert not failures and not unknown, (failures, unknown)


def check_eager_modules(site: Path) -> None:
    from vllm.model_executor.layers.fused_moe.experts import b12x_mxfp4_moe as b

    s = standin()
    with sm12x():
        assert b.B12xMxfp4Experts._supports_current_device()
    missing = [name for name in b.B12X_MOE_MODULES if name not in s.IMPORTED]
    assert not missing, missing
    assert len(b.B12X_MOE_MODULES) > 1


def check_provider_warmup(site: Path) -> None:
    """vLLM's own b12x warm-up (kernel_warmup's b12x_warmup) reaches the MoE layers of the
    target and of the speculator's draft model: every layer plans every b12x token bucket up
    to the scheduler's budget, one layer per shape launches each launch class."""
    from types import SimpleNamespace

    import torch
    from vllm.model_executor.warmup.b12x_warmup import b12x_warmup

    s = standin()
    model, draft = torch.nn.Module(), torch.nn.Module()
    for parent, name in ((model, "moe"), (model, "moe2"), (draft, "draft_moe")):
        method, layer = build_method()  # layers of one shape: launched once
        layer.quant_method = method
        parent.add_module(name, layer)
    worker = SimpleNamespace(
        get_model=lambda: model,
        get_draft_model=lambda: draft,
        scheduler_config=SimpleNamespace(max_num_batched_tokens=64),
        model_config=SimpleNamespace(dtype=torch.bfloat16),
    )
    s.CALLS.clear()
    with sm12x():
        b12x_warmup(worker, [1, 6, 24])
    names = [c[0] for c in s.CALLS]
    assert "route" not in names, names
    planned = sorted(c[1]["caps"].fields["max_tokens"] for c in s.CALLS if c[0] == "plan")
    assert planned == sorted([1, 2, 4, 8, 16, 32, 64] * 3), planned
    binds = [c[1]["a"].shape[0] for c in s.CALLS if c[0] == "Plan.bind"]
    # Counts up to 16 launch as 16 rows on SM12x (the 16-row minimum); 32 and 64 are the
    # buckets above the capture sizes.
    assert sorted(binds) == [16, 24, 32, 64], binds
    assert names.count("run") == 4, names


CHECKS = {n[len("check_"):]: f for n, f in globals().items() if n.startswith("check_")}


def main() -> None:
    import torch

    # vLLM's workspace manager empties the accelerator cache when it grows a workspace;
    # a CPU-only torch has no accelerator to empty (a GPU run does this for real).
    if not torch.accelerator.is_available():
        torch.accelerator.empty_cache = lambda: None
    from tests.overlay.tensor_checks import run_all

    print("@@RESULTS@@" + json.dumps(run_all(Path(sys.argv[1]), None, CHECKS)))


if __name__ == "__main__":
    main()
