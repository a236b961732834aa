"""Graph and warm-up coverage of one cluster file, through vLLM's own code (run in a subprocess).

``python coverage_checks.py SITE CLUSTER_TOML`` with a (patched) vLLM 0.28.0 tree first on
PYTHONPATH, then this directory and the b12x stand-in package (``b12x_standin.write_package``).
It prints ``@@RESULTS@@{json}``. The SM12x capability family is simulated.

1. The serving settings: dspark renders the head's vLLM command line from the cluster file;
   vLLM's own ``serve`` argument parser reads it. A real ``VllmConfig`` is built from
   them (the model's ``config.json`` is tests/fixtures/deepseek-v4-flash-config.json); the CPU
   platform empties the capture sizes, so vLLM's own ``_set_cudagraph_sizes`` sizes them again
   as it does on a CUDA device, from the cudagraph mode the optimization level gives (or the
   one the command line sets).
2. CUDA graphs: the DeepSeek V4 attention layers of every target and DSpark draft layer give
   their KV specs; vLLM groups them and its ``init_attn_backend`` builds the real metadata
   builders, whose ``get_cudagraph_support`` the cudagraph mode is resolved against
   (``resolve_cudagraph_mode_and_sizes``, as the V2 model runner does). The target's
   ``CudaGraphManager`` is built as the model runner builds it; the draft's by the DSpark
   speculator's own ``init_cudagraph_manager`` (whatever the overlay makes of it). Capture
   itself needs CUDA, so every descriptor the manager would capture is taken as captured;
   then ``dispatch`` is asked, as the runner and the speculator ask it, for 1..max_num_seqs
   requests: target verify batches (uniform q_len = k + 1) and draft batches (the
   speculator's own ``num_query_per_req``).
3. b12x token counts: b12x MoE layers (vLLM's Mxfp4MoEMethod on the b12x stand-in, which
   records every ``plan`` call) stand for the target's and the draft's MoE layers. vLLM's
   b12x warm-up (``b12x_warmup``, the entry kernel_warmup calls) runs with a worker whose
   ``get_model()`` is the target and whose model runner holds the DSpark speculator's draft
   model, then the graph capture's forwards (every descriptor of both managers, through
   every layer of its model). That is READY. Then every token count serving can reach goes
   through every layer: the target's from ``dispatch`` of every batch size
   1..max_num_batched_tokens (mixed batches) and of every verify batch, the draft's from
   ``dispatch`` of every draft batch. A whole forward (apply through vLLM's FusedMoEKernel,
   b12x bind and run) for the draft's counts, the target's up to the largest capture size
   and those at either side of each power of two; for the other counts vLLM's
   FusedMoEKernel sizing its buffers (``_allocate_buffers`` -> the experts'
   ``workspace_shapes``, where a forward first asks for a plan). A ``plan`` call then is a
   plan after READY.
"""

from __future__ import annotations

import json
import sys
import tempfile
import traceback
from pathlib import Path
from types import SimpleNamespace

HERE = Path(__file__).resolve().parent
FIXTURE = HERE.parents[0] / "fixtures" / "deepseek-v4-flash-config.json"
TARGET_MOE_LAYERS = 2  # layers of one shape: plans are per layer object in the overlay
DRAFT_MOE_LAYERS = 1


def serving_args(cluster_path: str):
    """The head's vLLM arguments as vLLM's own serve parser reads them."""
    from vllm.entrypoints.openai.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from dspark.config import validate as dc
    from dspark.node import launch as render

    cluster = dc.load(cluster_path)
    argv = render.vllm_argv(cluster, cluster.head)
    args = argv[argv.index("serve") + 1:]
    ns = make_arg_parser(FlexibleArgumentParser()).parse_args(args)
    return ns, argv


def build_config(ns, model_dir: str):
    from vllm.config import (
        CacheConfig,
        CompilationConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )
    from vllm.config.compilation import CUDAGraphMode
    from vllm.config.vllm import OPTIMIZATION_LEVEL_TO_CONFIG

    model = ModelConfig(model=model_dir, max_model_len=ns.max_model_len,
                        skip_tokenizer_init=True, dtype="bfloat16",
                        enforce_eager=bool(ns.enforce_eager))
    cache = CacheConfig(cache_dtype=ns.kv_cache_dtype, block_size=ns.block_size,
                        num_gpu_blocks_override=6)
    sched = SchedulerConfig(max_num_batched_tokens=ns.max_num_batched_tokens,
                            max_num_seqs=ns.max_num_seqs, max_model_len=ns.max_model_len,
                            is_encoder_decoder=False)
    user_cc = ns.compilation_config if isinstance(ns.compilation_config, CompilationConfig) else None
    vc = VllmConfig(model_config=model, cache_config=cache, scheduler_config=sched)
    # The CPU platform rewrites these for its own kernels; on the GB10 nodes they stand.
    vc.cache_config.block_size = ns.block_size
    vc.scheduler_config.max_num_batched_tokens = ns.max_num_batched_tokens
    spec = json.loads(ns.speculative_config) if isinstance(ns.speculative_config, str) else (
        ns.speculative_config or {})
    if not isinstance(spec, dict):
        spec = dict(vars(spec))
    k = int(spec.get("num_speculative_tokens") or 0)
    if spec.get("num_speculative_tokens_per_batch_size"):
        raise ValueError("dynamic speculative decoding is not modelled by this report")
    vc.speculative_config = SimpleNamespace(
        method=spec.get("method"), num_speculative_tokens=k, parallel_drafting=False,
        enable_adaptive_verification=bool(spec.get("enable_adaptive_verification", False)),
        use_dspark=lambda: spec.get("method") == "dspark",
        use_multi_module_mtp=lambda: False, use_eagle=lambda: False,
        uses_draft_model=lambda: False, uses_dynamic_speculative_decoding=lambda: False,
        num_speculative_tokens_per_batch_size=None, draft_model_config=model,
    ) if k else None
    cc = vc.compilation_config
    level = ns.optimization_level
    level_key = next((lv for lv in OPTIMIZATION_LEVEL_TO_CONFIG if str(lv.value) == str(
        getattr(level, "value", level))), None)
    mode = None if user_cc is None else user_cc.cudagraph_mode
    if mode is None:
        mode = OPTIMIZATION_LEVEL_TO_CONFIG[level_key]["compilation_config"]["cudagraph_mode"]
    if model.enforce_eager:
        mode = CUDAGraphMode.NONE
    cc.cudagraph_mode = mode
    # As EngineArgs.create_engine_config folds the two flags into the compilation config.
    cc.cudagraph_capture_sizes = (ns.cudagraph_capture_sizes
                                  if ns.cudagraph_capture_sizes is not None
                                  else None if user_cc is None else user_cc.cudagraph_capture_sizes)
    cc.max_cudagraph_capture_size = (ns.max_cudagraph_capture_size
                                     if ns.max_cudagraph_capture_size is not None
                                     else None if user_cc is None
                                     else user_cc.max_cudagraph_capture_size)
    vc._set_cudagraph_sizes()
    return vc, k


def attention_cg_support(vc):
    """(target, draft) AttentionCGSupport of the real DeepSeek V4 metadata builders."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.backend import AttentionCGSupport
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups, get_kv_cache_groups
    from vllm.v1.worker.gpu import attn_utils

    from tests.overlay import kv_layout_checks as kl

    kl.Layers(vc)  # registers every layer's KV-cache layers in the forward context
    hf = vc.model_config.hf_config
    groups = get_kv_cache_groups(vc, attn_utils.get_kv_cache_spec(vc))
    config = get_kv_cache_config_from_groups(vc, groups, 1 << 40)
    with set_current_vllm_config(vc):
        attn_groups, _, _ = attn_utils.init_attn_backend(config, vc, torch.device("cpu"))
    support = {"target": AttentionCGSupport.ALWAYS, "draft": AttentionCGSupport.ALWAYS}
    backend = {"target": None, "draft": None}
    for gs in attn_groups:
        for group in gs:
            s = group.get_metadata_builder(0).get_cudagraph_support(vc, group.kv_cache_spec)
            for name in group.layer_names:
                # KV-cache layer names: model.layers.<i>.attn[.swa_cache|.compressor...]
                index = int(name.split("model.layers.", 1)[1].split(".", 1)[0])
                role = "draft" if index > hf.num_hidden_layers else "target"
                if s.value < support[role].value:
                    support[role], backend[role] = s, group.backend.__name__
    return support, backend


def graph_managers(vc, k: int, support, backend):
    import torch
    import vllm.v1.worker.gpu.cudagraph_utils as cgu
    from vllm.v1.worker.gpu.spec_decode.dspark.speculator import DSparkSpeculator

    # The pipeline-parallel group of a single rank (no process group on this machine).
    cgu.get_pp_group = lambda: SimpleNamespace(is_first_rank=True, is_last_rank=True)
    # The graph memory pool is a CUDA handle; capture is not run here, so none is needed.
    platform = type(cgu.current_platform)
    if getattr(platform, "graph_pool_handle", None) is None:
        platform.graph_pool_handle = staticmethod(lambda: None)
    cc = vc.compilation_config
    decode_query_len = k + 1  # num_speculative_steps + one sampled token per step
    adaptive = bool(vc.speculative_config and vc.speculative_config.enable_adaptive_verification)
    if adaptive:
        from vllm.config.compilation import CUDAGraphMode
        cc.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE
    mode = cc.resolve_cudagraph_mode_and_sizes(
        support["target"], backend["target"], decode_query_len, use_v2_model_runner=True,
        tensor_parallel_size=vc.parallel_config.tensor_parallel_size,
        max_num_reqs=vc.scheduler_config.max_num_seqs)
    target = cgu.CudaGraphManager(vc, torch.device("cpu"), mode,
                                  decode_query_len=decode_query_len, varlen_decode=adaptive)
    draft = spec = None
    if k and vc.speculative_config.method == "dspark":
        # The speculator's fields that init_cudagraph_manager and propose read, set as its
        # __init__ sets them (DSparkSpeculator: sample_from_anchor defaults to True, so each
        # request emits num_speculative_tokens query tokens).
        spec = object.__new__(DSparkSpeculator)
        spec.vllm_config, spec.device = vc, torch.device("cpu")
        spec.num_speculative_steps = k
        anchor = getattr(vc.speculative_config.draft_model_config.hf_config,
                         "sample_from_anchor", True)
        spec.num_query_per_req = k if anchor else 1 + k
        spec.attn_cg_support = SimpleNamespace(min_cg_support=support["draft"],
                                               min_cg_attn_backend=backend["draft"])
        spec.init_cudagraph_manager(mode)
        draft = spec.query_cudagraph_manager
    for mgr in (target, draft):
        if mgr is not None:
            mgr._graphs_captured = True  # stands for capture(), which needs CUDA
    return mode, target, draft, spec


def captured(mgr) -> list:
    return [d for descs in mgr._capture_descs.values() for d in descs]


def graph_report(vc, k, target, draft, spec) -> dict:
    max_seqs = vc.scheduler_config.max_num_seqs
    out = {"target": [], "draft": []}
    caps = {id(target): set(captured(target))}
    q = k + 1
    for n in range(1, max_seqs + 1):
        d = target.dispatch(n, n * q, q, 0, max_query_len=q)
        in_graph = d.cg_mode.name != "NONE" and (d.cg_mode.name != "FULL" or d in caps[id(target)])
        out["target"].append({"reqs": n, "tokens": n * q, "mode": d.cg_mode.name,
                              "padded_tokens": d.num_tokens, "graph": in_graph})
    if draft is not None:
        dq = spec.num_query_per_req
        dcaps = set(captured(draft))
        for n in range(1, max_seqs + 1):
            d = draft.dispatch(n, n * dq, dq, 0)
            in_graph = d.cg_mode.name == "FULL" and d in dcaps
            out["draft"].append({"reqs": n, "tokens": n * dq, "mode": d.cg_mode.name,
                                 "padded_tokens": d.num_tokens, "graph": in_graph})
    out["draft_q_len"] = spec.num_query_per_req if spec is not None else None
    out["target_capture"] = sorted({d.num_tokens for d in captured(target)})
    out["draft_capture"] = sorted({d.num_tokens for d in captured(draft)}) if draft else []
    return out


def reachable(vc, k, target, draft, spec) -> tuple[list[int], list[int]]:
    """Token counts an MoE layer sees while serving: the padded size dispatch gives."""
    sched = vc.scheduler_config
    t = set()
    for tokens in range(1, sched.max_num_batched_tokens + 1):
        reqs = min(tokens, sched.max_num_seqs)
        t.add(target.dispatch(reqs, tokens, None, 0, max_query_len=tokens - reqs + 1).num_tokens)
    q = k + 1
    for n in range(1, sched.max_num_seqs + 1):
        t.add(target.dispatch(n, n * q, q, 0, max_query_len=q).num_tokens)
    d = set()
    if draft is not None:
        dq = spec.num_query_per_req
        for n in range(1, sched.max_num_seqs + 1):
            d.add(draft.dispatch(n, n * dq, dq, 0).num_tokens)
    return sorted(t), sorted(d)


def warmup_report(vc, target, draft, spec, reach_t, reach_d) -> dict:
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.warmup.b12x_warmup import b12x_warmup

    from tests.overlay import b12x_standin as s
    from tests.overlay import moe_checks as mc

    sizes = list(vc.compilation_config.cudagraph_capture_sizes or [])

    def moe_model(n):
        model = torch.nn.Module()
        for i in range(n):
            method, layer = mc.build_method()
            layer.quant_method = method
            model.add_module(f"moe{i}", layer)
        return model

    most = max([*reach_t, *reach_d, *sizes, 1])
    g = torch.Generator().manual_seed(0)
    x_all = torch.randn(most, mc.K, generator=g).to(torch.bfloat16)
    ids_all = torch.randint(0, mc.E, (most, mc.TOPK), generator=g, dtype=torch.int32)
    w_all = torch.rand(most, mc.TOPK, generator=g)

    def forward(model, tokens):
        x, ids, w = x_all[:tokens], ids_all[:tokens], w_all[:tokens]
        for layer in model.children():
            layer.quant_method.apply(layer, x, w, ids, shared_experts=None,
                                     shared_experts_input=None)

    def buffers(model, tokens):
        """vLLM's FusedMoEKernel sizing its buffers for a forward of ``tokens`` rows: the
        experts' workspace_shapes, where a forward first asks the experts for a plan."""
        for layer in model.children():
            impl = layer.quant_method.moe_kernel.impl
            fe = impl.fused_experts
            prepared = fe._prepared()
            impl._allocate_buffers(torch.bfloat16, torch.device("cpu"), tokens, tokens,
                                   2 * int(prepared.intermediate_size),
                                   int(prepared.hidden_size), mc.TOPK, mc.E, mc.E, None,
                                   fe.moe_config.activation)

    def plans_since(mark):
        return [c[1]["caps"].fields["max_tokens"] for c in s.CALLS[mark:] if c[0] == "plan"]

    target_model = moe_model(TARGET_MOE_LAYERS)
    draft_model = moe_model(DRAFT_MOE_LAYERS) if draft is not None else None
    # The worker's accessors the warm-up may read (vLLM's Worker has both).
    worker = SimpleNamespace(
        get_model=lambda: target_model,
        get_draft_model=lambda: draft_model,
        vllm_config=vc,
        scheduler_config=vc.scheduler_config,
        model_config=SimpleNamespace(dtype=torch.bfloat16),
    )
    s.CALLS.clear()
    # SM12x and a vLLM config stay current for warm-up, capture and serving alike.
    with set_current_vllm_config(vc), mc.sm12x():
        b12x_warmup(worker, sizes)
        warm = sorted(set(plans_since(0)))
        mark = len(s.CALLS)
        for d in captured(target):
            forward(target_model, d.num_tokens)
        if draft is not None:
            for d in captured(draft):
                forward(draft_model, d.num_tokens)
        capture = sorted(set(plans_since(mark)))
        ready = len(s.CALLS)
        late = {"target": {}, "draft": {}}
        # A whole forward (apply through FusedMoEKernel, b12x bind and run) for the counts
        # up to the largest capture size, each draft count and the counts at either side of
        # each power of two; vLLM's buffer sizing (the forward's first plan request) for
        # every other count: a whole forward of each of ~8,000 counts takes too long here.
        largest = max(sizes or [1])
        edges = {e for b in range(14) for e in ((1 << b), (1 << b) + 1)}
        for role, model, counts in (("target", target_model, reach_t),
                                    ("draft", draft_model, reach_d)):
            for i, tokens in enumerate(counts):
                if i % 2000 == 0:
                    print(f"serving {role}: {i}/{len(counts)}", file=sys.stderr, flush=True)
                mark = len(s.CALLS)
                if role == "draft" or tokens <= largest or tokens in edges:
                    forward(model, tokens)
                else:
                    buffers(model, tokens)
                got = plans_since(mark)
                if got:
                    late[role][tokens] = len(got)
        after_ready = len([c for c in s.CALLS[ready:] if c[0] == "plan"])
    return {"warmup_plans": warm, "capture_plans": capture, "late": late,
            "plan_calls_after_ready": after_ready}


def main() -> None:
    import torch

    if not torch.accelerator.is_available():
        torch.accelerator.empty_cache = lambda: None
    from tests.overlay import kv_layout_checks as kl

    kl._simulate_sm12x()
    cluster = sys.argv[2]
    result: dict = {}
    try:
        ns, argv = serving_args(cluster)
        result["argv"] = argv
        with tempfile.TemporaryDirectory() as tmp:
            Path(tmp, "config.json").write_text(FIXTURE.read_text())
            vc, k = build_config(ns, tmp)
            support, backend = attention_cg_support(vc)
            mode, target, draft, spec = graph_managers(vc, k, support, backend)
            result["settings"] = {
                "max_num_seqs": vc.scheduler_config.max_num_seqs,
                "max_num_batched_tokens": vc.scheduler_config.max_num_batched_tokens,
                "num_speculative_tokens": k,
                "cudagraph_mode": mode.name,
                "capture_sizes": list(vc.compilation_config.cudagraph_capture_sizes or []),
                "attention_cg_support": {r: v.name for r, v in support.items()},
                "attention_backend": backend,
            }
            result["graphs"] = graph_report(vc, k, target, draft, spec)
            reach_t, reach_d = reachable(vc, k, target, draft, spec)
            result["reachable"] = {"target": reach_t, "draft": reach_d}
            result["b12x"] = warmup_report(vc, target, draft, spec, reach_t, reach_d)
    except Exception:
        result["error"] = traceback.format_exc()
    print("@@RESULTS@@" + json.dumps(result))


if __name__ == "__main__":
    main()
