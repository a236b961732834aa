"""Torch-level checks of the overlay's pure helpers (0001), for any device; the attention
helpers of 0003 have theirs in attn_tensor_checks.py.

``run_all(module, device)`` takes the patched ``vllm.utils.spark_sm12x``
module object, so the same checks run on CPU tensors in CI (module imported
from a patched vLLM tree) and on CUDA tensors on a GPU machine without vLLM
(module loaded from the patch). Only torch is imported here.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable

import torch


def _raises(exc: type[BaseException], fn: Callable[[], object], text: str) -> None:
    try:
        fn()
    except exc as e:
        assert text in str(e), f"{text!r} not in {e!r}"
    else:
        raise AssertionError(f"{exc.__name__} not raised")


def check_b12x_scratch(m, device: str) -> None:
    # b12x's uint8 scratch carved from an activation-dtype workspace: same storage, no copy.
    nbytes = 12_345
    elems = m.b12x_scratch_elements(nbytes, torch.bfloat16.itemsize)
    assert elems == 6173 and m.b12x_scratch_elements(0, 2) == 1
    ws = torch.zeros(elems, dtype=torch.bfloat16, device=device)
    scratch = m.b12x_scratch_view(ws, nbytes)
    assert scratch.dtype == torch.uint8 and scratch.shape == (nbytes,)
    assert scratch.data_ptr() == ws.data_ptr() and scratch.device == ws.device
    scratch.fill_(0xFF)
    assert torch.isnan(ws[: nbytes // 2].float()).all()  # bf16 0xFFFF is NaN: one storage
    for bad in (ws[::2], None):
        try:
            m.b12x_scratch_view(bad, 8)
        except ValueError:
            continue
        raise AssertionError("a strided / missing workspace was accepted")
    try:
        m.b12x_scratch_view(ws, 2 * elems + 1)
    except ValueError:
        pass
    else:
        raise AssertionError("a too-small workspace was accepted")


def check_page_accounting(m, device: str) -> None:
    assert m.rewrite_mla_cache_dtype("nvfp4", True) == "nvfp4_ds_mla"
    assert m.rewrite_mla_cache_dtype("nvfp4", False) == "nvfp4"
    assert m.rewrite_mla_cache_dtype("fp8", True) == "fp8"
    assert m.dsv4_page_size_bytes(256, 4) == 64 * 584
    assert m.dsv4_page_size_bytes(256, 128) == 2 * 584
    assert m.dsv4_page_size_bytes(256, 1) == 256 * 584
    assert (m.ds_mla_alignment("nvfp4_ds_mla"), m.ds_mla_alignment("fp8_ds_mla"),
            m.ds_mla_alignment("auto")) == (584, 576, 512)


CHECKS = {
    "b12x_scratch": check_b12x_scratch,
    "page_accounting": check_page_accounting,
}


def run_all(module, device: str, checks: dict[str, Callable] = CHECKS) -> dict[str, str]:
    """Run every check; map its name to "ok" or the failure's traceback (the one loop the
    check scripts share: patched_checks.py and moe_checks.py call it with their own)."""
    results = {}
    for name, check in checks.items():
        try:
            check(module, device) if device is not None else check(module)
        except Exception:
            results[name] = traceback.format_exc()
        else:
            results[name] = "ok"
    return results
