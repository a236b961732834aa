"""Torch-level checks of the overlay's pure helpers, for any device.

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


def check_page_views(m, device: str) -> None:
    # A 256-token SWA block and a 64-token C4A block of 584-byte tokens.
    cache = torch.arange(3 * 256 * 584, device=device).to(torch.uint8).view(3, 256, 584)
    view = m.view_as_sm120_pages(cache)
    assert view.shape == (12, 64, 584), view.shape
    assert view.data_ptr() == cache.data_ptr()
    assert view.untyped_storage().data_ptr() == cache.untyped_storage().data_ptr()
    # Same bytes at the same flat token index: token 1*256+70 is page 5, slot 6.
    assert torch.equal(view[5, 6], cache[1, 70])
    view[11, 63].fill_(7)  # writes through to the cache
    assert int(cache[2, 255, 0]) == 7
    # 4-D (blocks, tokens, 1, 584) form keeps its head dim.
    view4 = m.view_as_sm120_pages(cache.unsqueeze(-2))
    assert view4.shape == (12, 64, 1, 584) and view4.data_ptr() == cache.data_ptr()
    # Pages already at most 64 tokens (C4A: 64, C128A: 2) are left as they are.
    c4a = torch.zeros(5, 64, 584, dtype=torch.uint8, device=device)
    c128a = torch.zeros(5, 2, 584, dtype=torch.uint8, device=device)
    assert m.view_as_sm120_pages(c4a) is c4a
    assert m.view_as_sm120_pages(c128a) is c128a
    # Other layouts pass through untouched.
    bf16 = torch.zeros(2, 256, 512, dtype=torch.bfloat16, device=device)
    assert m.view_as_sm120_pages(bf16) is bf16
    # Bad page size and bad strides fail clearly.
    odd = torch.zeros(2, 96, 584, dtype=torch.uint8, device=device)
    _raises(m.Sm12xLayoutError, lambda: m.view_as_sm120_pages(odd), "not a multiple of 64")
    padded = torch.zeros(2, 256 * 584 + 576, dtype=torch.uint8, device=device)
    strided = padded[:, : 256 * 584].view(2, 256, 584)
    _raises(m.Sm12xLayoutError, lambda: m.view_as_sm120_pages(strided), "page is padded")
    gappy = torch.zeros(2, 256, 600, dtype=torch.uint8, device=device)[..., :584]
    _raises(m.Sm12xLayoutError, lambda: m.view_as_sm120_pages(gappy), "not contiguous")


def check_index_padding(m, device: str) -> None:
    for width, target in ((1, 128), (128, 128), (133, 512), (192, 512), (256, 512),
                          (512, 512), (513, 1024), (1024, 1024)):
        idx = torch.randint(0, 1000, (7, 1, width), dtype=torch.int32, device=device)
        lens = torch.randint(0, width + 1, (7,), dtype=torch.int32, device=device)
        lens_before = lens.clone()
        out = m.pad_sparse_indices(idx)
        assert out.shape == (7, 1, target) and out.dtype == idx.dtype, (width, out.shape)
        assert torch.equal(out[..., :width], idx)
        assert bool((out[..., width:] == -1).all())
        assert torch.equal(lens, lens_before)  # top-k lengths unchanged
        if width == target:
            assert out is idx
    assert m.pad_sparse_indices(None) is None
    too_wide = torch.zeros(3, 1025, dtype=torch.int32, device=device)
    _raises(m.Sm12xLayoutError, lambda: m.pad_sparse_indices(too_wide), "1025")


def check_head_ladder(m, device: str) -> None:
    assert [m.pad_q_heads(h) for h in (1, 8, 9, 16, 17, 32, 33, 64, 65, 128)] == [
        8, 8, 16, 16, 32, 32, 64, 64, 128, 128
    ]
    assert m.pad_q_heads(64 // 2) == 32  # TP=2: 32 heads per rank stay 32
    _raises(ValueError, lambda: m.pad_q_heads(129), "129")


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


def check_q_len_snapping(m, device: str) -> None:
    on = [m.align_decode_q_len(q, sm12x=True) for q in range(0, 40)]
    assert on[1] == 1 and on[2] == 6 and on[3] == 6 and on[4] == 4 and on[5] == 6
    assert on[6] == 6 and on[7] == 8 and on[9] == 16 and on[36] == 36 and on[37] == 37
    assert on[0] == 0
    assert all(m.align_decode_q_len(q, sm12x=False) == q for q in range(0, 40))
    assert m.align_prefill_q_len(2, sm12x=True) == 6
    assert m.align_prefill_q_len(7, sm12x=True) == 8
    assert m.align_prefill_q_len(4, sm12x=True) == 6
    assert m.align_prefill_q_len(2, sm12x=False) == 2
    assert m.prefill_pad_message(2, sm12x=True) == (
        "SM12x: insert 4 extra KV slots for prefill pad 2 -> 6"
    )
    assert m.prefill_pad_message(2, sm12x=False) is None


def check_page_accounting(m, device: str) -> None:
    assert m.rewrite_mla_cache_dtype("nvfp4", True) == "nvfp4_ds_mla"
    assert m.rewrite_mla_cache_dtype("nvfp4", False) == "nvfp4"
    assert m.rewrite_mla_cache_dtype("fp8", True) == "fp8"
    assert m.dsv4_page_size_bytes(256, 4) == 64 * 584
    assert m.dsv4_page_size_bytes(256, 128) == 2 * 584
    assert m.dsv4_page_size_bytes(256, 1) == 256 * 584
    assert (m.ds_mla_alignment("nvfp4_ds_mla"), m.ds_mla_alignment("fp8_ds_mla"),
            m.ds_mla_alignment("auto")) == (584, 576, 512)
    # A page of the real allocator's size views cleanly as 64-token pages.
    page = m.dsv4_page_size_bytes(256, 1)
    raw = torch.zeros(4 * page, dtype=torch.uint8, device=device)
    assert m.view_as_sm120_pages(raw.view(4, 256, 584)).shape == (16, 64, 584)


CHECKS = {
    "page_views": check_page_views,
    "index_padding": check_index_padding,
    "head_ladder": check_head_ladder,
    "b12x_scratch": check_b12x_scratch,
    "q_len_snapping": check_q_len_snapping,
    "page_accounting": check_page_accounting,
}


def run_all(module, device: str) -> dict[str, str]:
    """Run every check; map its name to "ok" or the failure's traceback."""
    results = {}
    for name, check in CHECKS.items():
        try:
            check(module, device)
        except Exception:
            results[name] = traceback.format_exc()
        else:
            results[name] = "ok"
    return results
