"""Torch-level checks of vllm/utils/spark_sm12x_attn.py (overlay/0003), run
on any device: ``run_all(module, "cpu")`` in the default test run,
``run_all(module, "cuda")`` through run_cuda_checks.py on a GPU.

The padded-rows check runs a small sparse attention in torch (the same
arithmetic FlashInfer's kernel does: gather the indexed KV rows, skip -1,
softmax over the first top-k-length slots) with and without each request's
extra rows and compares the real rows' outputs exactly.
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


def check_per_request_rows(m, device):
    snap = lambda n: m.align_decode_q_len(n, sm12x=True)  # noqa: E731
    # Two DSpark draft requests of 5 rows: each becomes 6, its 6th row a copy
    # of its own last row (not the batch's).
    src, keep, padded = m.per_request_rows([5, 5], snap)
    assert padded == [6, 6]
    assert src == [0, 1, 2, 3, 4, 4, 5, 6, 7, 8, 9, 9], src
    assert keep == [0, 1, 2, 3, 4, 6, 7, 8, 9, 10], keep
    # Safe lengths (the target's 6-row verify, 1, 4, 8) change nothing.
    assert m.per_request_rows([6, 6, 6], snap) is None
    assert m.per_request_rows([1, 4, 8], snap) is None
    # A mixed batch: only the unsafe request grows.
    src, keep, padded = m.per_request_rows([6, 2], snap)
    assert padded == [6, 6] and src == [0, 1, 2, 3, 4, 5, 6, 7, 7, 7, 7, 7]
    assert keep == [0, 1, 2, 3, 4, 5, 6, 7]
    pre = lambda n: m.align_prefill_q_len(n, sm12x=True)  # noqa: E731
    src, keep, padded = m.per_request_rows([2, 3], pre)
    assert padded == [6, 6] and len(src) == 12 and keep == [0, 1, 6, 7, 8]


def check_uniform_rows_match_the_host_plan(m, device):
    for reqs, q_len, width in ((1, 5, 6), (2, 5, 6), (12, 5, 6), (3, 2, 6), (4, 7, 8)):
        src, keep = m.uniform_rows(reqs, q_len, width, torch.device(device))
        want_src, want_keep, _ = m.per_request_rows([q_len] * reqs, lambda n, width=width: width)
        assert src.device.type == device and keep.device.type == device
        assert src.tolist() == want_src and keep.tolist() == want_keep, (reqs, q_len)


def check_padded_rows_same_output(m, device):
    torch.manual_seed(0)
    heads, dim, slots = 4, 64, 300
    kv = torch.randn(slots, dim, device=device).to(torch.bfloat16)
    cases = (([2], m.align_prefill_q_len), ([5, 5], m.align_decode_q_len),
             ([7], m.align_decode_q_len), ([6, 3, 5], m.align_decode_q_len),
             ([2, 3, 100], m.align_prefill_q_len))
    for lens, align in cases:
        real = sum(lens)
        q = torch.randn(real, heads, dim, device=device).to(torch.bfloat16)
        idx = torch.randint(0, slots, (real, 1, 128), dtype=torch.int32, device=device)
        idx[:, :, 100:] = -1
        tlens = torch.randint(1, 101, (real,), dtype=torch.int32, device=device)
        want = torch.zeros(real, heads, dim, device=device, dtype=torch.bfloat16)
        _reference_sparse_attention(out=want, query=q, sparse_indices=idx,
                                    swa_topk_lens=tlens, kv=kv)
        src, keep, padded = m.per_request_rows(lens, lambda n, align=align: align(n, sm12x=True))
        seen = []

        def call(_seen=seen, **kw):
            _seen.append(kw["query"].shape[0])
            return _reference_sparse_attention(**kw)

        got = torch.full_like(want, float("nan"))
        m.run_rows(call, torch.tensor(src, device=device), torch.tensor(keep, device=device),
                   got, dict(query=q, sparse_indices=idx, swa_topk_lens=tlens), kv=kv)
        assert seen == [sum(padded)], (seen, padded)
        assert torch.equal(got, want), lens
    # No plan: the real rows go straight to the call, into the caller's output.
    got = torch.zeros(3, heads, dim, device=device, dtype=torch.bfloat16)
    outs = []
    m.run_rows(lambda **kw: outs.append(kw["out"]), None, None, got, dict(query=q[:3]))
    assert outs[0] is got


def check_q_len_snapping(m, device):
    on = [m.align_decode_q_len(n, sm12x=True) for n in (1, 2, 3, 4, 5, 6, 7, 15, 36, 37, 72)]
    assert on == [1, 6, 6, 4, 6, 6, 8, 16, 36, 37, 72], on
    assert [m.align_prefill_q_len(n, sm12x=True) for n in (2, 4, 5, 7, 16)] == [6, 6, 6, 8, 16]
    assert all(m.align_decode_q_len(n, sm12x=False) == n for n in range(1, 80))
    assert all(m.align_prefill_q_len(n, sm12x=False) == n for n in range(1, 80))
    # The log line says what happens: no KV slot is inserted.
    assert "write no KV slot" in m.PREFILL_PAD_MESSAGE
    assert "insert" not in m.PREFILL_PAD_MESSAGE


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
