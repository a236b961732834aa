"""A stand-in for b12x's fused-MoE API that enforces the real signatures.

``write_package(dest)`` writes a ``b12x`` package tree under ``dest`` whose modules are the
ones the overlay resolves; ``b12x.moe.fused_moe.api`` gets the functions below. Every call is
bound to the signature read from the pinned b12x sources (``b12x_contract``), every mode /
format string is checked against b12x's own vocabulary, and the results have the shapes and
types b12x returns. ``run`` writes a deterministic mixture into the caller's output so a test
can check what came back through vLLM's modular kernel. Calls are logged in ``CALLS``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tests.overlay import b12x_contract as contract

CALLS: list[tuple[str, dict[str, Any]]] = []
IMPORTED: list[str] = []

MODULES = (
    "b12x",
    "b12x.moe",
    "b12x.moe.fused_moe",
    "b12x.moe.fused_moe.api",
    "b12x.moe.fused_moe._impl",
    "b12x.moe._shared",
    "b12x.moe._shared.kernels",
    "b12x.moe._shared.kernels.tiny_decode",
    "b12x.moe._shared.kernels.w4a16",
    "b12x.moe._shared.kernels.w4a16.host",
    "b12x.moe._shared.kernels.w4a16.kernel",
    "b12x.moe._shared.kernels.w4a16.prepare",
    "b12x.moe._shared.kernels.w4a16.route_pack",
)


def write_package(dest: Path) -> Path:
    for name in MODULES:
        parts = name.split(".")
        is_pkg = any(m.startswith(name + ".") for m in MODULES)
        path = dest.joinpath(*parts) / "__init__.py" if is_pkg else dest.joinpath(*parts).with_suffix(".py")
        path.parent.mkdir(parents=True, exist_ok=True)
        body = "from tests.overlay import b12x_standin as _s\n_s.IMPORTED.append(__name__)\n"
        if name == "b12x.moe.fused_moe.api":
            body += "_s.install_api(globals())\n"
        if name == contract.W4A16_KERNEL:
            body += "_s.install_w4a16_kernel(globals())\n"
        path.write_text(body)
    return dest


def _bind(name: str, signature, args, kwargs) -> dict[str, Any]:
    bound = signature.bind(*args, **kwargs)  # TypeError exactly where b12x would raise one
    CALLS.append((name, dict(bound.arguments)))
    return bound.arguments


def _vocab(kind: str, value: str) -> None:
    allowed = contract.vocabulary()[kind]
    if value not in allowed:
        raise ValueError(f"b12x has no {kind} {value!r}; it accepts {sorted(allowed)}")


@dataclass(frozen=True)
class WeightsPlan:
    quant_modes: frozenset
    source_format: str
    activation: str
    io_dtype: str
    num_experts: int
    hidden_size: int
    intermediate_size: int
    w13_layout: str
    discards_source_parameters: bool = True


@dataclass
class ExpertWeights:
    plan: WeightsPlan
    w1_fp4: torch.Tensor
    w2_fp4: torch.Tensor
    w1_blockscale: torch.Tensor
    w2_blockscale: torch.Tensor

    @property
    def num_experts(self) -> int:
        return self.plan.num_experts

    @property
    def hidden_size(self) -> int:
        return self.plan.hidden_size

    @property
    def intermediate_size(self) -> int:
        return self.plan.intermediate_size


@dataclass(frozen=True)
class Caps:
    fields: dict

    def __getattr__(self, name):
        try:
            return self.__dict__["fields"][name]
        except KeyError:
            raise AttributeError(name) from None


@dataclass(frozen=True)
class ScratchSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device


def scratch_nbytes(caps: Caps) -> int:
    plan = caps.weight_plan
    return 4096 + caps.max_tokens * caps.num_topk * (plan.hidden_size + plan.intermediate_size) * 2


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    a0, b0 = a.data_ptr(), b.data_ptr()
    a1, b1 = a0 + a.numel() * a.element_size(), b0 + b.numel() * b.element_size()
    return a0 < b1 and b0 < a1


@dataclass
class Plan:
    caps: Caps
    bindings: list = field(default_factory=list)

    def scratch_specs(self):
        return (ScratchSpec((scratch_nbytes(self.caps),), torch.uint8,
                            torch.device(self.caps.device)),)

    def bind(self, *args, **kwargs):
        sig = contract.function_signature(contract.IMPL, "TPMoEScratchPlan.bind")
        kw = _bind("Plan.bind", sig, args, kwargs)
        scratch, a, experts = kw["scratch"], kw["a"], kw["experts"]
        if not isinstance(experts, ExpertWeights) or experts.plan != self.caps.weight_plan:
            raise ValueError("experts do not match the plan used to size TP MoE scratch")
        if scratch.dtype != torch.uint8 or scratch.dim() != 1 or not scratch.is_contiguous():
            raise TypeError(f"scratch must be a flat uint8 tensor, got {scratch.dtype} {tuple(scratch.shape)}")
        if scratch.numel() < scratch_nbytes(self.caps):
            raise ValueError(f"scratch {scratch.numel()} B < planned {scratch_nbytes(self.caps)} B")
        if a.shape[0] > self.caps.max_tokens:
            raise ValueError(f"input tokens {a.shape[0]} exceed scratch capacity {self.caps.max_tokens}")
        if a.shape[1] != experts.hidden_size:
            raise ValueError("input hidden size does not match the plan")
        ids, weights = kw["topk_ids"], kw["topk_weights"]
        if ids.shape != (a.shape[0], self.caps.num_topk) or ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"topk_ids {ids.dtype} {tuple(ids.shape)}")
        if weights.shape != ids.shape or weights.dtype != torch.float32:
            raise ValueError(f"topk_weights {weights.dtype} {tuple(weights.shape)}")
        out = kw.get("output")
        if out is not None:
            if out.dtype != a.dtype or out.shape != a.shape:
                raise TypeError(f"output {out.dtype} {tuple(out.shape)} for input {a.dtype} {tuple(a.shape)}")
            if _overlaps(out, scratch):
                raise ValueError("output overlaps the scratch")
        binding = dict(kw)
        self.bindings.append(binding)
        return binding


def expected_output(a: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """What the stand-in's ``run`` writes: sum_j w_j * (1 + id_j) * a (computed in fp32)."""
    scale = (weights.float() * (1 + ids.float())).sum(-1, keepdim=True)
    return (a.float() * scale).to(a.dtype)


# b12x's own host-side W4A16 tile selection (pure Python in the pinned sources), run as is.
W4A16_KERNEL_FUNCTIONS = ("_select_tile_config", "_candidate_tile_fits",
                          "_determine_blocks_per_sm", "_covering_count",
                          "_DEFAULT_MAX_SHARED_MEM")


def install_w4a16_kernel(ns: dict) -> None:
    ns.update(contract.real_functions(contract.W4A16_KERNEL, W4A16_KERNEL_FUNCTIONS))


def select_tiles(a: torch.Tensor, experts: ExpertWeights, top_k: int) -> None:
    """Ask the W4A16 kernel module's tile selector (whatever the module holds now, a wrapper
    included) for FC1 and FC2 of a launch, with the arguments b12x's
    ``compile_w4a16_fused_moe`` passes for byte-preserved E8M0 K/32 weights, its no-CUDA
    device figures (120 SMs, ``_DEFAULT_MAX_SHARED_MEM``) and its own route block size."""
    import sys

    kernel = sys.modules[contract.W4A16_KERNEL]
    host = contract.real_functions(contract.W4A16_HOST, ("select_route_block_size_m",))
    m, k, n = int(a.shape[0]), experts.hidden_size, experts.intermediate_size
    block = host["select_route_block_size_m"](m, top_k, experts.num_experts)
    common = dict(moe_block_size=block, sms=120, max_shared_mem=kernel._DEFAULT_MAX_SHARED_MEM,
                  scale_format="e8m0_k32", weight_layout="packed", weight_bits=4)
    for stage, args in (("fc1", dict(problem_m=m, problem_n=2 * n, problem_k=k, top_k=top_k)),
                        ("fc2", dict(problem_m=m * top_k, problem_n=k, problem_k=n, top_k=1))):
        tile = kernel._select_tile_config(**args, **common)
        CALLS.append(("select_tile_config", {"stage": stage, **args, **common, "tile": tile}))


def install_api(ns: dict) -> None:
    def plan_weights(*args, **kwargs):
        kw = _bind("plan_weights", contract.api_signature("plan_weights"), args, kwargs)
        modes = (kw["quant_modes"],) if isinstance(kw["quant_modes"], str) else tuple(kw["quant_modes"])
        for mode in modes:
            _vocab("quant_mode", mode)
        _vocab("source_format", kw["source_format"])
        _vocab("activation", kw["activation"])
        _vocab("w13_layout", kw.get("w13_layout", "w13"))
        for mode in modes:
            if not contract.valid_source_and_mode(kw["source_format"], mode):
                raise ValueError(f"source_format={kw['source_format']!r} with quant_mode={mode!r}")
        return WeightsPlan(
            quant_modes=frozenset(modes), source_format=kw["source_format"],
            activation=kw["activation"], io_dtype=str(kw["params_dtype"]).removeprefix("torch."),
            num_experts=int(kw["num_experts"]), hidden_size=int(kw["hidden_size"]),
            intermediate_size=int(kw["intermediate_size"]), w13_layout=kw.get("w13_layout", "w13"),
        )

    def prepare_weights(*args, **kwargs):
        kw = _bind("prepare_weights", contract.api_signature("prepare_weights"), args, kwargs)
        plan: WeightsPlan = kw["plan"]
        e, k, n = plan.num_experts, plan.hidden_size, plan.intermediate_size
        expect = {
            "w1_fp4": (e, 2 * n, k // 2), "w1_blockscale": (e, 2 * n, k // 32),
            "w2_fp4": (e, k, n // 2), "w2_blockscale": (e, k, n // 32),
        }
        for name, shape in expect.items():
            t = kw.get(name)
            if t is None or tuple(t.shape) != shape or t.dtype != torch.uint8:
                raise ValueError(f"{name}: {None if t is None else (t.dtype, tuple(t.shape))}, want uint8 {shape}")
        if str(kw["params_dtype"]).removeprefix("torch.") != plan.io_dtype:
            raise ValueError("params_dtype differs from the weight plan's")
        # b12x owns its packed copy: a clone stands for the W4A16 repack.
        return ExpertWeights(plan, *(kw[n].clone() for n in ("w1_fp4", "w2_fp4", "w1_blockscale", "w2_blockscale")))

    def caps(*args, **kwargs):
        kw = _bind("Caps", contract.dataclass_signature(contract.IMPL, "TPMoEScratchCaps"), args, kwargs)
        _vocab("quant_mode", kw["quant_mode"])
        if kw["quant_mode"] not in kw["weight_plan"].quant_modes:
            raise ValueError(f"quant_mode={kw['quant_mode']!r} is absent from the weight plan")
        full = {p.name: p.default for p in contract.dataclass_signature(
            contract.IMPL, "TPMoEScratchCaps").parameters.values()}
        full.update(kw)
        return Caps(full)

    def plan(*args, **kwargs):
        kw = _bind("plan", contract.api_signature("plan"), args, kwargs)
        if not isinstance(kw["caps"], Caps):
            raise TypeError("plan() takes a Caps")
        return Plan(kw["caps"])

    def required_nbytes(*args, **kwargs):
        kw = _bind("required_nbytes", contract.api_signature("required_nbytes"), args, kwargs)
        return scratch_nbytes(kw["caps"])

    def bind(*args, **kwargs):
        kw = _bind("bind", contract.api_signature("bind"), args, kwargs)
        return kw["plan"].bind(**kw["kwargs"])

    def run(*args, **kwargs):
        kw = _bind("run", contract.api_signature("run"), args, kwargs)
        b = kw["binding"]
        select_tiles(b["a"], b["experts"], int(b["topk_ids"].shape[1]))
        result = expected_output(b["a"], b["topk_ids"], b["topk_weights"])
        out = b.get("output")
        if out is None:
            return result
        out.copy_(result)
        return out

    def route(*args, **kwargs):
        _bind("route", contract.api_signature("route"), args, kwargs)
        raise AssertionError("route is b12x's gate/top-k router; the overlay must not call it")

    def is_supported(*args, **kwargs):
        _bind("is_supported", contract.api_signature("is_supported"), args, kwargs)
        return True

    ns.update(plan_weights=plan_weights, prepare_weights=prepare_weights, Caps=caps, plan=plan,
              required_nbytes=required_nbytes, bind=bind, run=run, route=route,
              is_supported=is_supported)
