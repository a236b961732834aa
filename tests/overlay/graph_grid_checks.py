"""How every uniform decode batch dispatches, through vLLM's own graph managers, for many settings.

Run in a subprocess whose PYTHONPATH puts a (patched) vLLM tree first (0.28.0 or 0.32.0), in
that tree's own Python: ``python graph_grid_checks.py SITE CASES_JSON``. CASES_JSON is a list
of settings ``{"S": max_num_seqs, "k": speculative tokens, "sizes": --cudagraph-capture-sizes or null,
"max": --max-cudagraph-capture-size or null, "mnbt": max_num_batched_tokens}``. Prints
``@@RESULTS@@`` and, per case, vLLM's final capture sizes and, for 1..S requests, the target's
verify batch (k + 1 tokens a request) and DSpark's draft batch (the speculator's own query
length) as ``[mode, padded tokens]``.

One real VllmConfig (SM12x simulated, with Model Runner V2 on 0.32.0 as on the nodes:
graph_dispatch_checks._model_runner_v2; FULL_AND_PIECEWISE, a DSpark speculative config) serves
every case: per case its scheduler's max_num_seqs is set, vLLM's own
``VllmConfig._set_cudagraph_sizes`` sizes a fresh ``CompilationConfig`` from the flags, the
target's ``CudaGraphManager`` is built as the model runner builds it and the draft's by
``DSparkSpeculator.init_cudagraph_manager``, and each batch goes through
``dispatch_cg_and_sync_dp`` with the arguments its caller passes. Capture needs a GPU, so the
managers are marked captured once ``_init_candidates`` has chosen what they would capture.

The target is FULL_AND_PIECEWISE on both lines. vLLM 0.32.0's runner keeps PIECEWISE only where
it can capture it (v1/worker/gpu/model_runner.py: piecewise_capture_available, a torch-compiled
submodule or VLLM_USE_BREAKABLE_CUDAGRAPH; else CompilationConfig.resolve_cudagraph_mode_and_sizes
gives FULL_DECODE_ONLY): its FULL candidates are kept apart from the PIECEWISE ones
(CudaGraphManager._init_candidates), so every FULL outcome is the same either way, and a batch
reported PIECEWISE here runs eagerly there.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace


def _setup():
    import vllm.distributed.parallel_state as ps
    import vllm.v1.worker.gpu.cudagraph_utils as cu

    from tests.overlay.graph_dispatch_checks import _simulate_sm12x

    _simulate_sm12x()
    # One rank, no process group: the managers only ask whether this is the first/last rank.
    ps.get_pp_group = lambda: SimpleNamespace(is_first_rank=True, is_last_rank=True)
    cu.get_pp_group = ps.get_pp_group


def _base_config():
    from vllm.config import CompilationConfig, SchedulerConfig, VllmConfig
    from vllm.config.compilation import CUDAGraphMode

    sched = SchedulerConfig(max_num_batched_tokens=8192, max_num_seqs=1, max_model_len=350000,
                            is_encoder_decoder=False)
    return VllmConfig(scheduler_config=sched, compilation_config=CompilationConfig(
        cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE))


def _sized(vc, case):
    """The case's flags through vLLM's own _set_cudagraph_sizes, into vc."""
    from vllm.config import CompilationConfig, VllmConfig
    from vllm.config.compilation import CUDAGraphMode

    k = case["k"]
    vc.scheduler_config.max_num_seqs = case["S"]
    vc.scheduler_config.max_num_batched_tokens = case["mnbt"]
    spec = SimpleNamespace(num_speculative_tokens=k, method="dspark",
                           uses_dynamic_speculative_decoding=lambda: False,
                           num_speculative_tokens_per_batch_size=None)
    # A flag left out (null) stays unset, as the command line leaves it: CompilationConfig
    # refuses an explicit None for the capture list (0.28.0 and 0.32.0).
    flags = {name: case[key] for name, key in (("cudagraph_capture_sizes", "sizes"),
                                               ("max_cudagraph_capture_size", "max"))
             if case[key] is not None}
    cc = CompilationConfig(cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE, **flags)
    # The fields _set_cudagraph_sizes reads (0.28.0, 0.29.0 and 0.32.0, whose default list adds
    # uniform decode sizes from uniform_decode_query_len, max_num_seqs and the speculative
    # config: vllm/config/vllm.py VllmConfig._set_cudagraph_sizes); a whole model config is not
    # needed for them.
    host = SimpleNamespace(
        model_config=SimpleNamespace(enforce_eager=False), compilation_config=cc,
        scheduler_config=vc.scheduler_config, parallel_config=vc.parallel_config,
        num_speculative_tokens=k, uniform_decode_query_len=k + 1, speculative_config=spec,
        performance_mode="balanced")
    VllmConfig._set_cudagraph_sizes(host)
    # The CPU platform turns CUDA graphs off; on the GB10 nodes this mode stands.
    cc.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE
    vc.compilation_config = cc
    vc.speculative_config = spec
    return cc


def _managers(vc, k):
    import torch
    from vllm.config.compilation import CUDAGraphMode
    from vllm.v1.worker.gpu.cudagraph_utils import CudaGraphManager

    from tests.overlay.graph_dispatch_checks import _draft_manager

    target = CudaGraphManager(vc, torch.device("cpu"), CUDAGraphMode.FULL_AND_PIECEWISE,
                              decode_query_len=k + 1)
    spec, draft = _draft_manager(vc, k)
    for mgr in (target, draft):
        mgr._graphs_captured = True  # capture itself needs a GPU
    return target, draft, spec.num_query_per_req


def _rows(manager, max_num_seqs: int, q: int, max_query_len: int | None) -> list:
    from vllm.v1.worker.gpu.dp_utils import dispatch_cg_and_sync_dp

    out = []
    for n in range(1, max_num_seqs + 1):
        desc, _ = dispatch_cg_and_sync_dp(manager, n, n * q, uniform_token_count=q, dp_size=1,
                                          dp_rank=0, max_query_len=max_query_len)
        out.append([desc.cg_mode.name, desc.num_tokens])
    return out


def main() -> None:
    _setup()
    cases = json.loads(Path(sys.argv[2]).read_text())
    vc = _base_config()
    out = []
    for case in cases:
        cc = _sized(vc, case)
        target, draft, dq = _managers(vc, case["k"])
        out.append({
            "sizes": list(cc.cudagraph_capture_sizes),
            "draft q_len": dq,
            "target": _rows(target, case["S"], case["k"] + 1, case["k"] + 1),
            "draft": _rows(draft, case["S"], dq, None),
            "graphs": {"target": sum(len(d) for d in target._capture_descs.values()),
                       "draft": sum(len(d) for d in draft._capture_descs.values())},
        })
    print("@@RESULTS@@" + json.dumps(out))


if __name__ == "__main__":
    main()
