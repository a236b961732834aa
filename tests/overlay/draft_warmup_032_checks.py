"""vLLM 0.32.0's b12x warm-up (model_executor/warmup/b12x_warmup.py b12x_warmup) with a DSpark
draft beside the target, run in a subprocess of the line's own Python whose PYTHONPATH puts a
(stock or patched) vLLM 0.32.0 tree first:
``python draft_warmup_032_checks.py SITE CAPTURE_SIZES_JSON MAX_NUM_BATCHED_TOKENS``.

The MoE layers carry vLLM's own b12x provider: B12xExperts (fused_moe/b12x.py), built with a
FusedMoEConfig of the checkpoint's expert shapes and the quant config vLLM's MXFP4 oracle makes
for b12x W4A16 (the line's VLLM_B12X_MOE_FP4_FORCE_A16=1), and attached to its layer as its
process_weights_after_loading attaches it. b12x itself and a GPU are absent here, so three
things stand in, and nothing else: the prepared expert weights (b12x's prepare_weights result:
its geometry and device, what get_b12x_warmup_unit reads), B12xExperts.warmup_launches (the
b12x launches a unit's compile makes; here it records which layer compiled and at which token
counts), and the CUDA platform with an SM12x capability and a no-op device synchronize.

Prints one JSON object after @@RESULTS@@: "b12x_warmup" -> the file the function came from, and
scenario -> {"compiled": the models whose layers compiled, in order, "counts": model -> the token
counts its compile got, "logged": what b12x_warmup logged}, or the scenario's traceback.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
import traceback
from types import SimpleNamespace

# DeepSeek-V4-Flash's routed experts (tests/fixtures/deepseek-v4-flash-config.json) at TP=2:
# 256 experts, hidden 4096, moe_intermediate_size 2048 (1024 a rank), 6 a token, SwiGLU limit 10.
EXPERTS, HIDDEN, INTERMEDIATE, TOP_K, SWIGLU_LIMIT, TP = 256, 4096, 2048, 6, 10.0, 2
TARGET_MOE_LAYERS = 4  # enough to show that one unit stands for every layer of a shape
DRAFT_MOE_LAYERS = 3  # DSpark's three draft layers (DSparkDeepseekV4Model.num_dspark_layers)


def _experts(num_experts: int):
    """vLLM's B12xExperts for one MoE layer, its weights prepared (stand-in for b12x's)."""
    import torch
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.b12x import B12xExperts
    from vllm.model_executor.layers.fused_moe.config import (
        FusedMoEConfig,
        FusedMoEParallelConfig,
        RoutingMethodType,
    )
    from vllm.model_executor.layers.fused_moe.oracle.mxfp4 import (
        Mxfp4MoeBackend,
        make_mxfp4_moe_quant_config,
    )

    parallel = FusedMoEParallelConfig(
        tp_size=TP, tp_rank=0, pcp_size=1, pcp_rank=0, dp_size=1, dp_rank=0, ep_size=1, ep_rank=0,
        sp_size=1, use_ep=False, all2all_backend="allgather_reducescatter", enable_eplb=False)
    moe = FusedMoEConfig(
        num_experts=num_experts, experts_per_token=TOP_K, hidden_dim=HIDDEN, intermediate_size=INTERMEDIATE,
        num_local_experts=num_experts, num_logical_experts=num_experts, activation=MoEActivation.SILU,
        device="cpu", routing_method=RoutingMethodType.DeepseekV4, moe_parallel_config=parallel,
        in_dtype=torch.bfloat16, swiglu_limit=SWIGLU_LIMIT)
    scale = torch.empty(0, dtype=torch.uint8)
    quant = make_mxfp4_moe_quant_config(Mxfp4MoeBackend.B12X_MXFP4_BF16, w1_scale=scale, w2_scale=scale,
                                        swiglu_limit=SWIGLU_LIMIT)
    layer = torch.nn.Module()
    layer.activation = MoEActivation.SILU
    layer.apply_router_weight_on_input = False
    experts = B12xExperts(moe, quant)
    prepared = SimpleNamespace(  # what b12x's prepare_weights returns, as far as vLLM reads it
        num_experts=num_experts, hidden_size=HIDDEN, intermediate_size=moe.intermediate_size_per_partition,
        w1_fp4=torch.empty(0, dtype=torch.uint8), plan=SimpleNamespace(discards_source_parameters=False))
    experts._reuse_prepared_storage(layer, prepared)
    layer.b12x_warmup_provider = experts  # as B12xExperts.process_weights_after_loading does
    return layer


def _model(name: str, layers: int, num_experts: int, owners: dict):
    import torch

    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([_experts(num_experts) for _ in range(layers)])
    for layer in model.layers:
        owners[id(layer.b12x_warmup_provider)] = name
    return model


@contextlib.contextmanager
def _sm12x(family: int | None, compiled: list):
    """The CUDA platform of capability family ``family`` (None: none), a no-op synchronize (no
    device here), and b12x's launches recorded."""
    import torch
    from vllm.model_executor.layers.fused_moe.b12x import B12xExperts
    from vllm.platforms import current_platform

    cls = type(current_platform)
    saved = {name: cls.__dict__.get(name) for name in ("is_cuda", "is_device_capability_family")}
    saved_launches, saved_sync = B12xExperts.warmup_launches, torch.accelerator.synchronize

    def launches(experts, layer, *, token_counts) -> int:
        compiled.append((experts, sorted(int(c) for c in token_counts)))
        return 1

    cls.is_cuda = lambda self: True
    cls.is_device_capability_family = staticmethod(lambda f: f == family)
    B12xExperts.warmup_launches = launches
    torch.accelerator.synchronize = lambda *a, **k: None
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                delattr(cls, name)
            else:
                setattr(cls, name, value)
        B12xExperts.warmup_launches, torch.accelerator.synchronize = saved_launches, saved_sync


class _Log(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def run_scenario(draft_experts: int | None, capture_sizes: list[int], max_batched: int,
                 family: int | None = 120) -> dict:
    """b12x_warmup on a worker whose target has TARGET_MOE_LAYERS MoE layers of the checkpoint's
    shape and whose draft (None: no draft) has DRAFT_MOE_LAYERS of ``draft_experts`` experts."""
    import torch
    import vllm.logger
    from vllm.model_executor.warmup import b12x_warmup as module

    owners: dict[int, str] = {}
    target = _model("target", TARGET_MOE_LAYERS, EXPERTS, owners)
    draft = _model("draft", DRAFT_MOE_LAYERS, draft_experts, owners) if draft_experts else None
    worker = SimpleNamespace(  # what b12x_warmup reads of vLLM's Worker
        vllm_config=SimpleNamespace(compilation_config=SimpleNamespace(compile_sizes=[])),
        scheduler_config=SimpleNamespace(max_num_batched_tokens=max_batched, max_num_scheduled_tokens=None),
        model_config=SimpleNamespace(dtype=torch.bfloat16),
        get_model=lambda: target, get_draft_model=lambda: draft)
    log, level = _Log(), module.logger.level
    module.logger.addHandler(log)
    module.logger.setLevel(logging.INFO)  # as vLLM's own logging configuration sets it
    vllm.logger._print_info_once.cache_clear()  # a server warms up once; each scenario here is one
    compiled: list = []
    try:
        with _sm12x(family, compiled):
            module.b12x_warmup(worker, list(capture_sizes))  # kernel_warmup passes the capture sizes
    finally:
        module.logger.removeHandler(log)
        module.logger.setLevel(level)
    return {
        "compiled": [owners[id(experts)] for experts, _ in compiled],
        "counts": {owners[id(experts)]: counts for experts, counts in compiled},
        "logged": log.lines,
    }


def main() -> None:
    capture_sizes, max_batched = json.loads(sys.argv[2]), int(sys.argv[3])
    scenarios = {
        # A draft whose MoE experts differ from the target's (here: 128 experts).
        "draft of its own shape": dict(draft_experts=EXPERTS // 2),
        # DeepSeek-V4-Flash's DSpark draft: DeepseekV4DecoderLayer of the target's own config.
        "draft of the target's shape": dict(draft_experts=EXPERTS),
        "no draft": dict(draft_experts=None),
        "off SM12x": dict(draft_experts=EXPERTS // 2, family=None),
    }
    from vllm.model_executor.warmup import b12x_warmup

    results: dict[str, object] = {"b12x_warmup": b12x_warmup.__file__}
    for name, kwargs in scenarios.items():
        try:
            results[name] = run_scenario(capture_sizes=capture_sizes, max_batched=max_batched, **kwargs)
        except Exception:
            results[name] = traceback.format_exc()
    print("@@RESULTS@@" + json.dumps(results))


if __name__ == "__main__":
    main()
