"""DeepSeek V4's KV layout and sparse-index widths through vLLM's own grouping,
packing, builders and SM120 attention class, against the locked FlashInfer's
SM120 dispatch (kv_layout_checks.py, run in a subprocess per tree)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from . import flashinfer_facts
from .conftest import run_checks

CHECKS = Path(__file__).with_name("kv_layout_checks.py")
LENS = (4096, 131072, 350000, 1048576)
ASPECTS = ("pages_and_strides", "group_pages_disjoint", "index widths", "start-up check")
DTYPES = ("nvfp4_ds_mla", "fp8_ds_mla")


def run_layout_checks(site: Path, dtypes: tuple[str, ...]) -> dict[str, str]:
    return run_checks(site, CHECKS, ",".join(dtypes), env={"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"}, timeout=900)


@pytest.fixture(scope="session")
def flashinfer():
    try:
        return flashinfer_facts.load()
    except FileNotFoundError as e:
        pytest.fail(str(e))


@pytest.fixture(scope="session")
def layout_results(patched_site, flashinfer) -> dict[str, str]:
    return run_layout_checks(patched_site, DTYPES)


def test_flashinfer_facts_are_read_from_the_locked_sources(flashinfer):
    # The dispatch the checks hold the overlay to, as the locked FlashInfer states it.
    assert flashinfer.version == flashinfer_facts.locked_version()
    # 0.6.18 (flashinfer #4380's widths 192 and 256 beside 128/512/1024).
    assert flashinfer.decode_widths(32) == (128, 192, 256, 512, 1024)
    assert flashinfer.decode_max_tokens == 64 and flashinfer.decode_page_tokens == 64
    assert flashinfer.prefill_dual_topks == (128,)
    assert flashinfer.bytes_per_token == 584 and flashinfer.io_stride == 576
    # The decode entry point's real signature, which every recorded call must bind to.
    sig = flashinfer.decode_signature
    assert list(sig.parameters)[:4] == ["query", "swa_kv_cache", "workspace_buffer", "sparse_indices"]
    assert {"extra_sparse_indices", "swa_topk_lens", "kv_layout"} <= set(sig.parameters)
    with pytest.raises(TypeError):  # a keyword FlashInfer does not take is refused
        sig.bind(None, None, None, None, sparse_index_width=512)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("max_len", LENS)
@pytest.mark.parametrize("aspect", ASPECTS)
def test_dsv4_layout_through_vllm(layout_results, dtype, max_len, aspect):
    key = f"{dtype} max_model_len={max_len}"
    assert f"{key}: layout" not in layout_results, layout_results[f"{key}: layout"]
    assert layout_results[f"{key}: {aspect}"] == "ok", layout_results[f"{key}: {aspect}"]


def test_every_layer_of_the_model_is_built(layout_results):
    # 43 target layers and DSpark's 3 draft layers, each with its SWA cache,
    # under the SpeculativeConfig vLLM builds for DSpark (use_eagle() is True).
    layers = json.loads(layout_results["nvfp4_ds_mla max_model_len=350000: layers"])
    assert layers == {"attention": 46, "swa caches": 46, "draft": 3, "use_eagle": True}, layers


def test_c128a_widths_reach_flashinfer_unpadded(layout_results):
    # C128A indices are round_up(cdiv(max_model_len, 128), 128) wide; FlashInfer
    # takes the compressed segment's width as a runtime value, so they pass as is.
    for max_len in LENS:
        seen = json.loads(layout_results[f"nvfp4_ds_mla max_model_len={max_len}: widths seen"])
        extra = {w[2] for w in seen if w[2] is not None}
        c128a = -(-(-(-max_len // 128)) // 128) * 128
        assert c128a in extra and 512 in extra, (max_len, seen)


def test_short_calls_reach_flashinfer_with_gb10_row_counts(layout_results):
    # Seed 000: decode q_len snapping and the 2 -> 6 prefill pad, applied at the
    # FlashInfer call of real batches (rows = query rows FlashInfer receives).
    rows = json.loads(layout_results["nvfp4_ds_mla max_model_len=350000: rows seen"])
    assert rows["prefill 2 tokens"] == [6]
    assert rows["decode 1 seq, DSpark draft (5 rows)"] == [6]
    assert rows["decode 1 seq, no speculation (1 row)"] == [1]
    assert rows["decode 1 seq, target verify (6 rows)"] == [6]
    assert rows["decode 10 seqs, target verify (60 rows)"] == [60]
    assert rows["prefill 100 tokens"] == [100]


def test_the_snap_is_per_request_query_length(layout_results):
    # The v0.28.0 line snaps each request's query length, not the batch's row
    # count: a target verify batch (6 rows a request, a width that ran on GB10)
    # reaches FlashInfer as it is, a DSpark draft batch as 6 rows a request,
    # and each request of a prefill chunk on its own.
    rows = json.loads(layout_results["nvfp4_ds_mla max_model_len=350000: rows seen"])
    assert rows["decode 2 seqs, target verify (12 rows)"] == [12]
    assert rows["decode 3 seqs, target verify (18 rows)"] == [18]
    assert rows["decode 5 seqs, target verify (30 rows)"] == [30]
    assert rows["decode 2 seqs, DSpark draft (10 rows)"] == [12]
    assert rows["decode 5 seqs, DSpark draft (25 rows)"] == [30]
    assert rows["decode 12 seqs, DSpark draft (60 rows)"] == [72]
    assert rows["prefill 2 + 3 tokens (two requests, one chunk)"] == [12]
    assert rows["prefill 7 + 100 tokens (two requests, one chunk)"] == [108]


def test_the_dspark_draft_width_needs_no_padding_on_the_locked_flashinfer(layout_results):
    # FlashInfer 0.6.18 has a 192-wide SM120 decode kernel: 0003 reads the table
    # at run time and passes DSpark's non-causal 192-wide indices as they are.
    seen = json.loads(layout_results["nvfp4_ds_mla max_model_len=350000: widths seen"])
    assert [True, 192, None] in seen, seen
    assert not any(w[1] == 512 for w in seen), seen


def test_stock_vllm_launches_the_row_counts_the_line_saw_fault(stock_site, flashinfer):
    # Stock 0.28.0 launches a 2-token prefill and DSpark's 5-row draft block as
    # they come (the v0.28.0 line's illegal memory accesses on GB10); with
    # FlashInfer 0.6.18 its DSpark width (192) is no longer refused.
    results = run_layout_checks(stock_site, ("fp8_ds_mla",))
    assert results["fp8_ds_mla max_model_len=350000: index widths"] == "ok"
    rows = json.loads(results["fp8_ds_mla max_model_len=350000: rows seen"])
    assert rows["prefill 2 tokens"] == [2], rows
    assert rows["decode 1 seq, DSpark draft (5 rows)"] == [5], rows
    assert rows["decode 2 seqs, DSpark draft (10 rows)"] == [10], rows
