"""Which FlashInfer workspace each call of DeepSeek V4's SM120 attention class receives.

Run in a subprocess whose PYTHONPATH puts a vLLM tree first (0.28.0 or 0.32.0, in its own Python):
``python workspace_checks.py SITE [DTYPE]``, DTYPE in the seed line's vocabulary (sent as the
installed release's line names it: ``line_cache_dtype``). Prints one JSON object after
@@RESULTS@@.

vLLM's own code builds the layers, specs, packed KV caches and metadata builders as
kv_layout_checks.py does (a real VllmConfig of DeepSeek V4 Flash at TP=2 with DSpark k=5,
max_model_len 4,096, SM12x simulated), then runs the SM120 attention class's own
``_forward_sparse_impl`` (its ``_forward_decode`` and ``_forward_prefill``) over kv_layout_checks'
batches with its own ``_get_workspace``: nothing stands in for the workspace. FlashInfer's entry
point is kv_layout_checks' recorder, which also keeps the ``workspace_buffer`` of every call.

CUDA-graph capture is simulated as SM12x is: ``torch.cuda.is_current_stream_capturing`` (which
raises on the CPU build) answers True while a batch that vLLM runs as a FULL graph runs (a
uniform decode batch: the target's verify and DSpark's draft blocks; the DeepSeek V4 metadata
builders support UNIFORM_BATCH graphs), False otherwise (prefills, mixed batches), and for the
profile run, which goes first, as vLLM's does (``_reserve_empty_forward_workspace`` asks
``_get_workspace`` eagerly; its CUDA device is replaced by the CPU one here).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent

from tests.overlay import flashinfer_facts  # noqa: E402
from tests.overlay import kv_layout_checks as K  # noqa: E402

MAX_MODEL_LEN = 4096


class WorkspaceRecorder(K.Recorder):
    """kv_layout_checks' FlashInfer recorder that also notes each call's workspace and phase."""

    def __init__(self, fi):
        super().__init__(fi)
        self.phase = ""
        self.captured = False
        self.workspaces: list[dict] = []

    def _check(self, *, workspace_buffer, **kwargs):
        storage = workspace_buffer.untyped_storage()
        start = storage.data_ptr() + workspace_buffer.storage_offset() * workspace_buffer.element_size()
        self.workspaces.append(dict(phase=self.phase, captured=self.captured, start=start,
                                    end=start + workspace_buffer.numel() * workspace_buffer.element_size(),
                                    tensor=id(workspace_buffer)))
        return super()._check(workspace_buffer=workspace_buffer, **kwargs)


def _overlaps(a: dict, b: dict) -> bool:
    return a["start"] < b["end"] and b["start"] < a["end"]


def _held(flashinfer_sparse) -> dict[str, list[int]]:
    """Every per-device workspace dict of the module: name -> ids of the tensors it holds."""
    return {name: sorted(id(t) for t in value.values()) for name, value in vars(flashinfer_sparse).items()
            if name.endswith("workspace_by_device") and isinstance(value, dict)}


def line_cache_dtype(seed_name: str) -> str:
    """The cache dtype dspark sends the installed vLLM for the seed line's name: its runtime
    line's vocabulary (dspark.lines.runtime.render_settings). On vLLM 0.32.0 the seed's
    nvfp4_ds_mla (the 584-byte SM12x token of overlay 0002) is sent as fp8_ds_mla, which
    DeepseekV4FlashInferSM120Attention takes on SM12x (use_fp8_ds_mla_layout, checked by
    vllm/models/deepseek_v4/attention.py _resolve_dsv4_kv_cache_dtype); 0.32.0's own
    nvfp4_ds_mla is another, SM100-only format that the class refuses. On 0.28.0 the name stays;
    a release no line names keeps it too."""
    import vllm

    from dspark.lines import runtime as runtime_lines

    release = vllm.__version__.split("+")[0]
    line = next((x for x in runtime_lines.load().lines.values() if x.vllm == release), None)
    if line is None:
        return seed_name
    return runtime_lines.render_settings(line, {"kv_cache_dtype": seed_name}).values["kv_cache_dtype"]


def run(cache_dtype: str) -> dict[str, str]:
    import torch
    from vllm.models.deepseek_v4.nvidia import flashinfer_sparse

    from tests.overlay.graph_dispatch_checks import _model_runner_v2

    # The FlashInfer the tree's runtime line pins, as kv_layout_checks holds the tree to it
    # (0.32.0: flashinfer-python 0.7.0.post1, whose SM120 dispatch flashinfer_facts alone cannot
    # read); a kv_layout_checks without that choice reads flashinfer_facts' pin (0.28.0's).
    fi = getattr(K, "_load_flashinfer", flashinfer_facts.load)()
    K._simulate_sm12x()
    _model_runner_v2()  # 0.32.0: the runner the nodes use (vllm/config/vllm.py use_v2_model_runner)
    cache_dtype = line_cache_dtype(cache_dtype)
    recorder = WorkspaceRecorder(fi)
    torch.cuda.is_current_stream_capturing = lambda: recorder.captured
    flashinfer_sparse.flashinfer_trtllm_batch_decode_sparse_mla_dsv4 = recorder
    flashinfer_sparse.compute_global_topk_indices_and_lens = K._global_topk_stand_in
    A = flashinfer_sparse.DeepseekV4FlashInferSM120Attention
    def phased(real, phase):
        def wrapped(self, *args, **kwargs):
            recorder.phase = phase
            try:
                return real(self, *args, **kwargs)
            finally:
                recorder.phase = ""
        return wrapped

    for name in ("_forward_decode", "_forward_prefill"):  # the real methods, with the phase noted
        setattr(A, name, phased(getattr(A, name), name[len("_forward_"):]))

    results: dict[str, str] = {"cache dtype": cache_dtype}
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "config.json").write_text(K.FIXTURE.read_text())
        layers = K.Layers(K._config(tmp, cache_dtype, MAX_MODEL_LEN)).plan()
    # vLLM's profile run (eager): the class's own reservation, on this machine's device.
    A._get_workspace(torch.device("cpu"))
    held = _held(flashinfer_sparse)
    results["held after the profile run"] = json.dumps({k: len(v) for k, v in held.items()})

    hf = layers.vc.model_config.hf_config
    kinds = {}
    for layer in layers.attn.values():
        kinds.setdefault((layer.compress_ratio, layer.layer_id >= hf.num_hidden_layers), layer)
    errors = []
    for name, decodes, q_len, prefill_lens, causal in K.SCENARIOS:
        for (_, draft), layer in sorted(kinds.items()):
            if draft == causal:
                continue
            swa = K._swa_metadata(layers, layer, decodes=decodes, q_len=q_len,
                                  prefill_lens=prefill_lens, causal=causal)
            md = K._mla_metadata(layers, layer, swa)
            tokens = swa.num_decode_tokens + swa.num_prefill_tokens
            q = torch.zeros(tokens, K.HEADS_PER_RANK, hf.head_dim, dtype=torch.bfloat16)
            out = torch.zeros(tokens, layer.padded_heads, hf.head_dim, dtype=torch.bfloat16)
            recorder.captured = decodes > 0 and not prefill_lens  # vLLM's FULL graphs: uniform decodes
            try:
                layer._forward_sparse_impl(
                    q=q, output=out, flashmla_metadata=md, swa_metadata=swa,
                    self_kv_cache=layer.kv_cache if layer.compress_ratio > 1 else None,
                    swa_kv_cache=layer.swa_cache_layer.kv_cache, swa_only=layer.compress_ratio <= 1)
            except Exception as e:  # noqa: BLE001 - reported as the result
                errors.append(f"{name}, ratio {layer.compress_ratio}: {type(e).__name__}: {e}")
            finally:
                recorder.captured = False
    errors += recorder.refusals
    results["calls"] = "\n".join(errors) or "ok"

    calls = recorder.workspaces
    captured = [c for c in calls if c["captured"]]
    eager_prefill = [c for c in calls if not c["captured"] and c["phase"] == "prefill"]
    eager_decode = [c for c in calls if not c["captured"] and c["phase"] == "decode"]
    results["seen"] = json.dumps({"captured decode": len(captured), "eager prefill": len(eager_prefill),
                                  "eager decode": len(eager_decode),
                                  "captured prefill": sum(c["phase"] == "prefill" for c in captured)})
    for what, group in (("prefill", eager_prefill), ("eager decode", eager_decode)):
        hits = sorted({(hex(c["start"]), hex(g["start"])) for c in group for g in captured if _overlaps(c, g)})
        results[f"{what} apart from the captured decodes' workspace"] = (
            "ok" if group and captured and not hits else
            f"{len(hits)} overlap(s) of a {what} call's workspace with a captured decode's: {hits[:4]}"
            if hits else f"nothing to compare ({len(group)} eager, {len(captured)} captured calls)")
    sizes = sorted({c["end"] - c["start"] for c in calls})
    results["workspace sizes"] = json.dumps(sizes)
    graph_buffers = sorted({c["tensor"] for c in captured})
    results["captured decodes share one workspace"] = (
        "ok" if len(graph_buffers) == 1 else f"{len(graph_buffers)} workspaces among the captured calls")
    results["nothing allocated after the profile run"] = (
        "ok" if _held(flashinfer_sparse) == held else
        f"held {json.dumps({k: len(v) for k, v in _held(flashinfer_sparse).items()})} after the batches")
    return results


def main() -> None:
    cache_dtype = sys.argv[2] if len(sys.argv) > 2 else "nvfp4_ds_mla"
    try:
        results = run(cache_dtype)
    except Exception:
        results = {"run": traceback.format_exc()}
    print("@@RESULTS@@" + json.dumps(results))


if __name__ == "__main__":
    os.environ.setdefault("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    main()
