"""Torch-level checks of vllm/utils/spark_sm12x_attn.py (overlay/0003), run
on any device: ``run_all(module, "cpu")`` in the default test run,
``run_all(module, "cuda")`` through run_cuda_checks.py on a GPU.

The padded-rows check runs a small sparse attention in torch (the same
arithmetic FlashInfer's kernel does: gather the indexed KV rows, skip -1,
softmax over the first top-k-length slots) with and without the extra rows
and compares the real rows' outputs exactly.
"""

from __future__ import annotations

import traceback

import torch


def _reference_sparse_attention(*, out, query, sparse_indices, swa_topk_lens, kv):
    """out[t] = softmax(q[t] . kv[idx[t, :len[t]]]) @ kv[...] per head."""
    idx = sparse_indices.reshape(query.shape[0], -1)
    for t in range(query.shape[0]):
        n = int(swa_topk_lens[t])
        rows = idx[t, :n]
        rows = rows[rows >= 0]
        keys = kv[rows.long()].float()  # [n, d]
        scores = query[t].float() @ keys.T  # [heads, n]
        out[t] = (torch.softmax(scores, dim=-1) @ keys).to(out.dtype)
    return out


def check_index_width(m, device):
    widths = (128, 512, 1024)
    assert [m.decode_index_width(w, widths) for w in (1, 128, 129, 192, 512, 1024)] == [
        128, 128, 512, 512, 512, 1024]
    try:
        m.decode_index_width(2816, widths)
    except m.Sm12xIndexWidthError as e:
        assert "2816" in str(e)
    else:
        raise AssertionError("2816 accepted as a decode SWA width")


def check_pad_index_width(m, device):
    idx = torch.arange(6 * 192, dtype=torch.int32, device=device).view(6, 1, 192)
    padded = m.pad_index_width(idx, 512)
    assert padded.shape == (6, 1, 512) and padded.dtype == torch.int32
    assert padded.device == idx.device and padded.is_contiguous()
    assert torch.equal(padded[..., :192], idx)
    assert bool((padded[..., 192:] == -1).all())
    assert m.pad_index_width(idx, 192) is idx
    try:
        m.pad_index_width(idx, 128)
    except m.Sm12xIndexWidthError:
        pass
    else:
        raise AssertionError("narrowing accepted")


def check_pad_rows(m, device):
    q = torch.randn(2, 32, 512, device=device).to(torch.bfloat16)
    p = m.pad_rows(q, 6)
    assert p.shape == (6, 32, 512) and p.is_contiguous()
    assert torch.equal(p[:2], q) and torch.equal(p[2:], q[-1:].expand(4, 32, 512))
    lens = torch.tensor([3, 7], dtype=torch.int32, device=device)
    assert m.pad_rows(lens, 6).tolist() == [3, 7, 7, 7, 7, 7]
    assert m.pad_rows(q, 2) is q and m.pad_rows(None, 6) is None


def check_padded_rows_same_output(m, device):
    torch.manual_seed(0)
    heads, dim, slots = 4, 64, 300
    kv = torch.randn(slots, dim, device=device).to(torch.bfloat16)
    for real, rows in ((2, 6), (3, 6), (5, 6), (7, 8), (6, 6)):
        q = torch.randn(real, heads, dim, device=device).to(torch.bfloat16)
        idx = torch.randint(0, slots, (real, 1, 128), dtype=torch.int32, device=device)
        idx[:, :, 100:] = -1
        lens = torch.randint(1, 101, (real,), dtype=torch.int32, device=device)
        want = torch.zeros(real, heads, dim, device=device, dtype=torch.bfloat16)
        _reference_sparse_attention(out=want, query=q, sparse_indices=idx,
                                    swa_topk_lens=lens, kv=kv)
        seen = []

        def call(**kw):
            seen.append(kw["query"].shape[0])
            return _reference_sparse_attention(**kw)

        got = torch.full_like(want, float("nan"))
        m.run_padded_rows(call, rows, got,
                          dict(query=q, sparse_indices=idx, swa_topk_lens=lens), kv=kv)
        assert seen == [rows], (seen, rows)
        assert torch.equal(got, want), (real, rows)


def check_q_len_snapping(m, device):
    on = [m.align_decode_q_len(n, sm12x=True) for n in (1, 2, 3, 4, 5, 6, 7, 15, 36, 37, 72)]
    assert on == [1, 6, 6, 4, 6, 6, 8, 16, 36, 37, 72], on
    assert [m.align_prefill_q_len(n, sm12x=True) for n in (2, 4, 5, 7, 16)] == [6, 6, 6, 8, 16]
    assert all(m.align_decode_q_len(n, sm12x=False) == n for n in range(1, 80))
    assert all(m.align_prefill_q_len(n, sm12x=False) == n for n in range(1, 80))
    assert m.prefill_pad_message(2, 6) == (
        "SM12x: insert 4 extra KV slots for prefill pad 2 -> 6")
    assert m.prefill_pad_message(6, 6) is None


def check_capture_sizes(m, device):
    sizes = [1, 2, 4, 8, 16, 24, 32, 36]
    assert m.dspark_capture_sizes(sizes, 6, sm12x=True) == [6, 12, 18, 24, 36]
    assert m.dspark_capture_sizes(sizes, 5, sm12x=True) == [6, 12, 18, 24, 36]
    assert m.dspark_capture_sizes([1, 2, 4, 8, 12, 16, 24], 4, sm12x=True) == [
        4, 8, 12, 16, 24]
    off = m.dspark_capture_sizes(sizes, 6, sm12x=False)
    assert off == sizes and off is not sizes


CHECKS = {name[len("check_"):]: fn for name, fn in globals().items()
          if name.startswith("check_")}


def run_all(module, device: str) -> dict[str, str]:
    results = {}
    for name, fn in CHECKS.items():
        try:
            fn(module, device)
        except Exception:
            results[name] = traceback.format_exc()
        else:
            results[name] = "ok"
    return results
