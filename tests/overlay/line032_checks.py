"""Checks run inside a vLLM 0.32.0 tree patched with the v0.32.0 line's series
(overlay/lines/v0.32.0/series), in a subprocess of the line's own Python whose
PYTHONPATH puts the patched copy first. The same meaning as patched_checks.py's
checks of 0001, 0003 and 0007 on vLLM 0.28.0, written against 0.32.0's API where it
moved; 0002 is not carried on this line: the seed's nvfp4_ds_mla is sent as upstream's
fp8_ds_mla, whose layout check_fp8_ds_mla_layout pins. Prints one JSON object: check
name -> "ok" or the failure's traceback. Run as ``python line032_checks.py PATCHED_SITE``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

# The 0.28.0 checks whose code holds unchanged on 0.32.0 (tests.overlay, run as a module from the repository).
from tests.overlay.patched_checks import (  # noqa: E402
    _with_family,
    check_tensor_logic,
    check_warmup_prompt_len,
    imported_from,
)

# The modules the v0.32.0 series patches or creates.
PATCHED_MODULES = (
    "vllm.utils.spark_sm12x",
    "vllm.utils.spark_sm12x_attn",
    "vllm.models.deepseek_v4.sparse_mla",
    "vllm.models.deepseek_v4.nvidia.flashinfer_sparse",
    "vllm.v1.attention.backends.mla.sparse_swa",
    "vllm.v1.worker.gpu.warmup",
    "vllm.distributed.device_communicators.shm_broadcast",
)


def check_imports(site: Path) -> None:
    import vllm

    assert vllm.__version__.split("+")[0] == "0.32.0", vllm.__version__
    imported_from(site, PATCHED_MODULES)


def check_flashinfer_backend(site: Path) -> None:
    """The SM120 class plans each request's rows on SM12x only (0003), without the SWA width
    padding (FlashInfer 0.7.0.post1's SM120 DSv4 decode takes any top-k); the backend takes
    fp8_ds_mla on SM12x and refuses it on SM10x."""
    import vllm.utils.spark_sm12x_attn as m
    from vllm.models.deepseek_v4.nvidia.flashinfer_sparse import (
        DeepseekV4FlashInferMLASparseBackend as B,
    )
    from vllm.models.deepseek_v4.nvidia.flashinfer_sparse import (
        DeepseekV4FlashInferSM120Attention as A,
    )
    from vllm.platforms.interface import DeviceCapability

    args = dict(head_size=512, dtype=None, block_size=256, use_mla=True, has_sink=True,
                use_sparse=True, use_mm_prefix=False)
    assert B.supports_combination(kv_cache_dtype="fp8_ds_mla", device_capability=DeviceCapability(10, 0),
                                  **args) is not None
    sm121 = B.supports_combination(kv_cache_dtype="fp8_ds_mla", device_capability=DeviceCapability(12, 1), **args)
    assert sm121 is None or "kv_cache_dtype" not in sm121, sm121  # FlashInfer itself is not installed here
    assert A.use_fp8_ds_mla_layout is True
    assert not hasattr(m, "pad_index_width") and not hasattr(m, "decode_index_width")
    md = _uniform_decode(reqs=2, q_len=5)
    src, keep = _with_family(120, lambda: A._sm12x_decode_rows(md, "cpu"))
    assert src.tolist() == [0, 1, 2, 3, 4, 4, 5, 6, 7, 8, 9, 9] and keep.tolist() == [0, 1, 2, 3, 4, 6, 7, 8, 9, 10]
    assert _with_family(None, lambda: A._sm12x_decode_rows(md, "cpu")) == (None, None)
    assert _with_family(120, lambda: A._sm12x_decode_rows(_uniform_decode(reqs=3, q_len=6), "cpu")) == (None, None)


def _uniform_decode(reqs: int, q_len: int):
    import torch
    from vllm.v1.attention.backends.mla.sparse_swa import DeepseekSparseSWAMetadata

    qsl = torch.arange(reqs + 1, dtype=torch.int32) * q_len
    return DeepseekSparseSWAMetadata(
        block_table=torch.zeros(reqs, 1, dtype=torch.int32), slot_mapping=torch.zeros(0),
        block_size=64, query_start_loc=qsl, query_start_loc_cpu=qsl, num_decodes=reqs,
        num_decode_tokens=reqs * q_len, max_decode_query_len=q_len)


def check_short_extend_split(site: Path) -> None:
    """0011: on SM12x a prompt of up to the decode threshold is a prefill when a request of the
    batch is prefilling; off SM12x, or with no is_prefilling (DSpark's draft step), vLLM's split."""
    import torch
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.attention.backends.mla.sparse_swa import split_short_extends_as_prefills

    qsl = torch.tensor([0, 6, 12, 16], dtype=torch.int32)
    seq = torch.tensor([100, 100, 4], dtype=torch.int32)

    def cm(flags):
        return CommonAttentionMetadata(
            query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=seq, num_reqs=3, num_actual_tokens=16,
            max_query_len=6, max_seq_len=100, block_table_tensor=torch.zeros(3, 1, dtype=torch.int32),
            slot_mapping=torch.zeros(16, dtype=torch.int64), is_prefilling=flags, seq_lens_cpu_upper_bound=seq)

    flags = torch.tensor([False, False, True])
    assert _with_family(120, lambda: split_short_extends_as_prefills(cm(flags), 6)) == (2, 1, 12, 4)
    assert _with_family(None, lambda: split_short_extends_as_prefills(cm(flags), 6)) == (3, 0, 16, 0)
    assert _with_family(120, lambda: split_short_extends_as_prefills(cm(None), 6)) == (3, 0, 16, 0)


CHECKS = {
    "imports": check_imports,
    "tensor_logic": check_tensor_logic,
    "flashinfer_backend": check_flashinfer_backend,
    "short_extend_split": check_short_extend_split,
    "warmup_prompt_len": check_warmup_prompt_len,
}


def main() -> None:
    from tests.overlay.tensor_checks import run_all

    print("@@RESULTS@@" + json.dumps(run_all(Path(sys.argv[1]), None, CHECKS)))


if __name__ == "__main__":
    main()
