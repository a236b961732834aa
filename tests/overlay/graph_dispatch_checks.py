"""Which decode batches replay a CUDA graph, through vLLM's own graph managers.

Run in a subprocess whose PYTHONPATH puts a (patched or stock) vLLM 0.28.0 or
0.32.0 tree first, in that tree's own Python: ``python graph_dispatch_checks.py
SITE``. Prints one JSON object after
``@@RESULTS@@``: for the target model and for DSpark's draft, each batch size
1..max_num_seqs -> the CUDA-graph mode vLLM's dispatcher picks ("FULL",
"PIECEWISE", "NONE").

Nothing is faked between the config and the dispatcher: a real VllmConfig of
the appliance's shape (DSpark k=5, 12 sequences, vLLM's default capture
sizes) with the SM12x capability family simulated (and, on 0.32.0, Model Runner
V2 chosen as on the nodes: ``_model_runner_v2``); the draft's graph manager is
built by ``DSparkSpeculator.init_cudagraph_manager`` itself (whatever the
overlay does there runs), the target's by ``ModelCudaGraphManager``; both
dispatch through ``dispatch_cg_and_sync_dp`` with the arguments their callers
pass (the draft: ``uniform_token_count=num_query_per_req`` as
``DFlashSpeculator.propose`` does; the target: the uniform verify length k+1).
Capturing needs a GPU, so the managers are marked captured after
``_init_candidates`` has chosen what they would capture.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

NUM_SPEC = 5
MAX_NUM_SEQS = 12


def _simulate_sm12x() -> None:
    from vllm.platforms import current_platform

    from tests.overlay.kv_layout_checks import _simulate_sm12x as simulate_family

    simulate_family()
    # The managers take a handle on the platform's graph memory pool (a CUDA
    # object); nothing is captured here, so any token stands in for it.
    type(current_platform).graph_pool_handle = staticmethod(lambda: object())
    _model_runner_v2()


def _model_runner_v2() -> None:
    """Model Runner V2 on vLLM 0.32.0, as the GB10 nodes run it. 0.32.0 decides the runner in
    VllmConfig.use_v2_model_runner (vllm/config/vllm.py): VLLM_USE_V2_MODEL_RUNNER, else V1
    where Triton is missing (HAS_TRITON), and _validate_v2_model_runner refuses V2 without
    Triton. The CPU build's Triton has no CPU backend, the nodes' has: the variable is set and
    the config module is told Triton is there. Before 0.32.0 nothing is changed (these checks
    ran the 0.28.0 line as they always have)."""
    import os

    import vllm
    import vllm.config.vllm as config_module

    release = tuple(int(x) for x in vllm.__version__.split("+")[0].split(".")[:2])
    if release < (0, 32):
        return
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    config_module.HAS_TRITON = True


def _config():
    from vllm.config import CompilationConfig, SchedulerConfig, VllmConfig
    from vllm.config.compilation import CUDAGraphMode

    sched = SchedulerConfig(max_num_batched_tokens=8192, max_num_seqs=MAX_NUM_SEQS,
                            max_model_len=350000, is_encoder_decoder=False)
    # vLLM's default capture sizes up to max_num_seqs x (k + 1), as the appliance
    # renders --max-cudagraph-capture-size.
    comp = CompilationConfig(max_cudagraph_capture_size=MAX_NUM_SEQS * (NUM_SPEC + 1),
                             cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE)
    vc = VllmConfig(scheduler_config=sched, compilation_config=comp)
    # The CPU platform turns CUDA graphs off; on the GB10 nodes these stand.
    vc.compilation_config.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE
    vc.compilation_config.max_cudagraph_capture_size = MAX_NUM_SEQS * (NUM_SPEC + 1)
    sizes = vc.compilation_config.cudagraph_capture_sizes
    if not sizes:
        # The CPU platform leaves the list empty; vLLM's own default rule fills it.
        vc.compilation_config.cudagraph_capture_sizes = sizes = [
            s for s in [1, 2, 4] + list(range(8, 256, 8)) if s <= MAX_NUM_SEQS * (NUM_SPEC + 1)]
    vc.speculative_config = SimpleNamespace(
        num_speculative_tokens=NUM_SPEC,
        uses_dynamic_speculative_decoding=lambda: False,
    )
    return vc


def _draft_manager(vc, k: int = NUM_SPEC):
    """The draft's manager as DSparkSpeculator.init_cudagraph_manager builds it."""
    import torch
    from vllm.config.compilation import CUDAGraphMode
    from vllm.v1.attention.backend import AttentionCGSupport
    from vllm.v1.worker.gpu.spec_decode.dspark.speculator import DSparkSpeculator

    spec = object.__new__(DSparkSpeculator)
    spec.vllm_config = vc
    spec.device = torch.device("cpu")
    spec.num_speculative_steps = k
    # DSparkSpeculator.__init__'s rule: sample_from_anchor (the checkpoint's
    # default) drafts N query tokens per request, not 1 + N.
    spec.sample_from_anchor = True
    spec.num_query_per_req = k
    spec.attn_cg_support = SimpleNamespace(
        min_cg_support=AttentionCGSupport.UNIFORM_BATCH, min_cg_attn_backend="FLASHINFER_MLA_SPARSE_DSV4")
    spec.init_cudagraph_manager(CUDAGraphMode.FULL_AND_PIECEWISE)
    return spec, spec.query_cudagraph_manager


def _target_manager(vc):
    import torch
    from vllm.v1.worker.gpu.cudagraph_utils import ModelCudaGraphManager

    return ModelCudaGraphManager(vc, torch.device("cpu"), vc.compilation_config.cudagraph_mode,
                                 decode_query_len=NUM_SPEC + 1)


def _modes(manager, q_len: int) -> dict[str, str]:
    from vllm.v1.worker.gpu.dp_utils import dispatch_cg_and_sync_dp

    manager._graphs_captured = True  # capture itself needs a GPU
    out = {}
    for n in range(1, MAX_NUM_SEQS + 1):
        desc, _ = dispatch_cg_and_sync_dp(manager, n, n * q_len, uniform_token_count=q_len,
                                          dp_size=1, dp_rank=0)
        out[str(n)] = desc.cg_mode.name
    return out


def main() -> None:
    import vllm.distributed.parallel_state as ps

    _simulate_sm12x()
    # One rank, no process group: the managers only ask whether this is the
    # first/last pipeline rank.
    ps.get_pp_group = lambda: SimpleNamespace(is_first_rank=True, is_last_rank=True)
    import vllm.v1.worker.gpu.cudagraph_utils as cu

    cu.get_pp_group = ps.get_pp_group
    vc = _config()
    spec, draft = _draft_manager(vc)
    results = {
        "capture sizes": vc.compilation_config.cudagraph_capture_sizes,
        "draft q_len": spec.num_query_per_req,
        "draft": _modes(draft, spec.num_query_per_req),
        "draft captured token counts": sorted({d.num_tokens for ds in draft._capture_descs.values()
                                               for d in ds}),
        "target": _modes(_target_manager(vc), NUM_SPEC + 1),
    }
    print("@@RESULTS@@" + json.dumps(results))


if __name__ == "__main__":
    main()
