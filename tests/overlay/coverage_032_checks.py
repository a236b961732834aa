"""b12x warm-up coverage on runtime line v0.32.0: which b12x 1.5.1 MoE kernel signatures vLLM
0.32.0's warm-up compiles before READY, and which token counts serving reaches whose signature it
did not compile (the line's equivalent of v0.28.0's "plans after READY", coverage_checks.py).

``python coverage_032_checks.py SITE B12X_SRC CAPTURE_SIZES_JSON MAX_NUM_BATCHED_TOKENS K
MAX_NUM_SEQS`` in the line's own Python with a (patched) vLLM 0.32.0 tree first on PYTHONPATH;
B12X_SRC is the pinned b12x 1.5.1 wheel unpacked (appended to the path only after vLLM is
imported, so vLLM's has_b12x() stays as it is here: b12x's kernels import CUDA and CuTe, absent).

The signature is vLLM's own: B12xExperts.warmup_launches compiles one launch per distinct
``(execution_plan.implementation, execution_plan.execution)`` of b12x's
``fused_moe.plan_execution(num_tokens=...)`` and relies on it ("B12X deduplicates shapes that
select the same internal kernel policy", vllm/utils/b12x.py). What runs, and what stands in:

- vLLM's own: b12x_warmup (the patched tree's, 0014 included) on a worker whose target and DSpark
  draft hold B12xExperts of the checkpoint's shapes (draft_warmup_032_checks._model, with its
  stand-ins: the prepared weights, the SM12x platform); B12xExperts.warmup_launches and its
  deduplication; B12xExperts._plan / workspace_shapes (the first thing a forward asks) for the
  capture sizes (graph capture) and for every count serving reaches.
- b12x 1.5.1's own: make_moe_spec and lower_moe_execution (b12x/moe/_shared/execution.py,
  imported) and select_route_block_size_m with its constants (moe/_shared/kernels/w4a16/host.py,
  taken out of the file by its syntax tree: that package's __init__ imports CUDA).
- Stand-in: the glue of b12x's plan_tp_moe_execution (moe/fused_moe/_impl.py, which imports
  cuda.bindings and cutlass at the top) for the W4A16 mode vLLM's MXFP4 oracle selects on this
  line (VLLM_B12X_MOE_FP4_FORCE_A16=1): implementation "w4a16" (its _resolve_workspace_layout
  raises for any other backend in that mode), regime MATERIALIZED_PERSISTENT, no tiles, no
  deterministic reduction (_dynamic_deterministic_output_enabled is False for w4a16),
  route_block_rows = select_route_block_size_m(num_tokens, top_k, num_experts). The weight plan's
  required layout is passed as None: it is one value per weight plan, the same for every count.
  b12x's plan/bind/run stand in too (they record the token count a plan is made for).

Not run here: b12x's kernel compiles themselves (CuTe DSL, a GPU), so whether a plan for a new
count inside a warmed signature compiles anything (b12x's own caches, its per-M TC-decode and
small-M direct kernels below 9 tokens) is not established by this script.

Prints one JSON object after @@RESULTS@@ (or "error": a traceback).
"""

from __future__ import annotations

import ast
import json
import sys
import traceback
from pathlib import Path
from types import SimpleNamespace

HERE = Path(__file__).resolve().parent
HOST = Path("b12x", "moe", "_shared", "kernels", "w4a16", "host.py")


def load_b12x(b12x_src: Path) -> None:
    """The pinned b12x sources as the package ``b12x``, found in ``b12x_src`` only (sys.path
    unchanged): its submodules resolve through the package's __path__."""
    import importlib.machinery
    import importlib.util

    spec = importlib.machinery.PathFinder.find_spec("b12x", [str(b12x_src)])
    assert spec is not None and spec.loader is not None, f"no b12x package under {b12x_src}"
    module = importlib.util.module_from_spec(spec)
    sys.modules["b12x"] = module
    spec.loader.exec_module(module)


def host_policy(b12x_src: Path):
    """b12x's select_route_block_size_m with the module constants it reads, from host.py."""
    tree = ast.parse((b12x_src / HOST).read_text())
    wanted = {"_W4A16_ALLOWED_ROUTED_SIZES", "_ROUTED_SIZE_TARGET_FILL", "select_route_block_size_m"}
    body = [n for n in tree.body
            if (isinstance(n, ast.FunctionDef) and n.name in wanted)
            or (isinstance(n, ast.Assign) and any(getattr(t, "id", None) in wanted for t in n.targets))]
    ns: dict = {}
    exec(compile(ast.Module(body=body, type_ignores=[]), str(b12x_src / HOST), "exec"), ns)
    return ns["select_route_block_size_m"], ns["_W4A16_ALLOWED_ROUTED_SIZES"], ns["_ROUTED_SIZE_TARGET_FILL"]


class B12xFusedMoe:
    """Stand-in for ``b12x.moe.fused_moe`` as vLLM's b12x.py calls it: plan_execution from b12x's
    own lowering (see the module docstring), plan/bind/run recording the counts planned."""

    def __init__(self, select_route_block_size_m):
        from b12x.moe._shared.execution import MoERegime, lower_moe_execution, make_moe_spec

        self._lower, self._regime, self._spec = lower_moe_execution, MoERegime, make_moe_spec
        self._select = select_route_block_size_m
        self.planned: list[int] = []
        self.launched: list[int] = []

    def plan_execution(self, *, num_tokens, num_topk, device, weight_plan, quant_mode,
                       apply_router_weight_on_input, swiglu_limit, swiglu_alpha, swiglu_beta):
        if quant_mode != "w4a16":
            raise NotImplementedError(f"only the line's W4A16 mode is modelled, not {quant_mode!r}")
        spec = self._spec(quant_mode="w4a16", source_format=weight_plan.source_format, activation="silu",
                          io_dtype="bfloat16", w13_layout=weight_plan.w13_layout,
                          apply_router_weight_on_input=apply_router_weight_on_input)
        execution = self._lower(
            spec, regime=self._regime.MATERIALIZED_PERSISTENT, tile_m=None, tile_n=None,
            route_block_rows=self._select(num_tokens, num_topk, weight_plan.num_experts),
            deterministic_output=False, scheduler=None, required_weight_layout=None)
        return SimpleNamespace(implementation="w4a16", execution=execution)

    def Caps(self, **fields):  # noqa: N802 (b12x's class name)
        return SimpleNamespace(**fields)

    def plan(self, caps):
        import torch

        self.planned.append(int(caps.max_tokens))
        spec = SimpleNamespace(dtype=torch.uint8, shape=(1,))
        return SimpleNamespace(max_tokens=int(caps.max_tokens), scratch_specs=lambda: [spec])

    def bind(self, plan, **_):
        return plan

    def run(self, *, binding):
        self.launched.append(binding.max_tokens)


def signature_name(sig) -> str:
    implementation, execution = sig
    return f"{implementation}/{execution.regime.value}/route_block_rows={execution.route_block_rows}"


def ranges(counts: list[int]) -> list[list[int]]:
    out: list[list[int]] = []
    for c in counts:
        if out and out[-1][1] == c - 1:
            out[-1][1] = c
        else:
            out.append([c, c])
    return out


def report(b12x_src: Path, sizes: list[int], max_batched: int, k: int, max_seqs: int) -> dict:
    import torch
    from vllm.model_executor.layers.fused_moe import b12x as vllm_b12x
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.warmup import b12x_warmup as module

    from tests.overlay import draft_warmup_032_checks as dw

    load_b12x(b12x_src)  # after vLLM's import: has_b12x() is unchanged
    select, routed_sizes, fill = host_policy(b12x_src)
    fused = B12xFusedMoe(select)
    owners: dict[int, str] = {}
    target = dw._model("target", dw.TARGET_MOE_LAYERS, dw.EXPERTS, owners)
    draft = dw._model("draft", dw.DRAFT_MOE_LAYERS, dw.EXPERTS, owners)  # the target's config
    for model in (target, draft):  # b12x's weight plan, as far as plan_execution reads it
        for layer in model.layers:
            experts = layer.b12x_warmup_provider
            experts._prepared_experts.plan = SimpleNamespace(
                source_format=experts._source_format, w13_layout=experts._w13_layout,
                num_experts=dw.EXPERTS, discards_source_parameters=False)
    worker = SimpleNamespace(
        vllm_config=SimpleNamespace(compilation_config=SimpleNamespace(compile_sizes=[])),
        scheduler_config=SimpleNamespace(max_num_batched_tokens=max_batched, max_num_scheduled_tokens=None),
        model_config=SimpleNamespace(dtype=torch.bfloat16),
        get_model=lambda: target, get_draft_model=lambda: draft)
    real_launches = vllm_b12x.B12xExperts.warmup_launches
    saved = vllm_b12x.get_b12x_fused_moe, vllm_b12x._is_current_stream_capturing
    vllm_b12x.get_b12x_fused_moe = lambda: fused
    vllm_b12x._is_current_stream_capturing = lambda: False  # no CUDA stream on this machine
    try:
        with dw._sm12x(120, []):
            handed: list[tuple[int, ...]] = []

            def recording(self, layer, *, token_counts):  # vLLM's own, with its dedup, and what it got
                handed.append(tuple(token_counts))
                return real_launches(self, layer, token_counts=token_counts)

            vllm_b12x.B12xExperts.warmup_launches = recording
            module.b12x_warmup(worker, list(sizes))
            vllm_b12x.B12xExperts.warmup_launches = real_launches
            warm_counts = sorted(set(fused.planned))  # the representatives warmup_launches launched
            # Graph capture: a forward of every capture size through every MoE layer; its first
            # b12x call is workspace_shapes -> _plan (a plan made during capture raises).
            for model in (target, draft):
                for layer in model.layers:
                    for m in sizes:
                        layer.b12x_warmup_provider.workspace_shapes(
                            m, 0, dw.HIDDEN, dw.TOP_K, dw.EXPERTS, dw.EXPERTS, None, MoEActivation.SILU)
            ready = len(fused.planned)
            experts = target.layers[0].b12x_warmup_provider
            for m in range(1, max_batched + 1):
                experts.workspace_shapes(m, 0, dw.HIDDEN, dw.TOP_K, dw.EXPERTS, dw.EXPERTS, None,
                                         MoEActivation.SILU)
            late_plans = sorted(set(fused.planned[ready:]))
    finally:
        vllm_b12x.get_b12x_fused_moe, vllm_b12x._is_current_stream_capturing = saved

    def sig(m):
        p = fused.plan_execution(num_tokens=m, num_topk=dw.TOP_K, device="cpu",
                                 weight_plan=experts._prepared_experts.plan, quant_mode="w4a16",
                                 apply_router_weight_on_input=False, swiglu_limit=None,
                                 swiglu_alpha=None, swiglu_beta=None)
        return (p.implementation, p.execution)

    warmed = {signature_name(sig(m)) for m in warm_counts}
    # Every count an MoE layer can see while serving lies in 1..max_num_batched_tokens (dispatch
    # pads up to a capture size, which is one of these, or leaves the count as it is): the reach
    # here is that whole range, a superset of dispatch's, with the verify (n(k+1)) and draft (nk)
    # batches of 1..max_num_seqs requests named apart. A count above the largest capture size runs
    # eagerly at its exact length (one prompt or chunk of that many tokens), so every late count
    # found above it is reached, not merely reachable.
    reach: dict[str, list[int]] = {}
    for m in range(1, max_batched + 1):
        reach.setdefault(signature_name(sig(m)), []).append(m)
    verify = [n * (k + 1) for n in range(1, max_seqs + 1)]
    drafts = [n * k for n in range(1, max_seqs + 1)]
    late = {name: ranges(counts) for name, counts in reach.items() if name not in warmed}
    assert all(lo > max(sizes) for rs in late.values() for lo, _ in rs), late
    return {
        "b12x_warmup": module.__file__,
        "policy": {"routed_sizes": list(routed_sizes), "target_fill": fill},
        "warmup_counts": sorted(set().union(*handed)),  # what the tree's b12x_warmup handed the units
        "upstream_counts": list(warmup_counts(sizes, max_batched)),
        "compiled_launch_counts": sorted(fused.launched),
        "warmed_signatures": sorted(warmed),
        "signatures_after_ready": late,
        "late_token_counts": sum(hi - lo + 1 for rs in late.values() for lo, hi in rs),
        "reach": {name: ranges(counts) for name, counts in reach.items()},
        "verify_signatures": sorted({signature_name(sig(m)) for m in verify}),
        "draft_signatures": sorted({signature_name(sig(m)) for m in drafts}),
        "plans_after_ready": len(late_plans),
        "plans_after_ready_counts": ranges(late_plans),
    }


def warmup_counts(sizes: list[int], max_batched: int) -> tuple[int, ...]:
    """The counts b12x_warmup hands every unit (as it builds them, compile_sizes empty)."""
    from vllm.utils.b12x import b12x_warmup_token_counts

    return b12x_warmup_token_counts(max_tokens=max_batched, cudagraph_capture_sizes=[max_batched, *sizes])


def main() -> None:
    b12x_src, sizes = Path(sys.argv[2]), json.loads(sys.argv[3])
    max_batched, k, max_seqs = int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
    try:
        result = report(b12x_src, sizes, max_batched, k, max_seqs)
    except Exception:
        result = {"error": traceback.format_exc()}
    print("@@RESULTS@@" + json.dumps(result))


if __name__ == "__main__":
    main()
