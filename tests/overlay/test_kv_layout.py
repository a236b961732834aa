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
        blocks = -(-max_len // 128)  # cdiv(max_len, 128)
        c128a = -(-blocks // 128) * 128  # round_up(blocks, 128)
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
    # With DSpark stock vLLM splits every prompt of up to 11 tokens as a decode and launches
    # it at its own row count: a 4-token prompt as 4 rows, the mixed step as [1000] and
    # [16] (the series before 0011 did the same, snapping 2, 3, 5 -> 6 but keeping 4).
    short = short_prompt_table(results)["DSpark k=5"]
    assert short["4"]["alone"] == [["decode", 4]], short["4"]
    assert short["2"]["alone"] == [["decode", 2]], short["2"]
    assert short["4"]["+ 2 decodes + 1000-token prompt"] == [["prefill", 1000], ["decode", 16]], short["4"]
    # Stock pads no prompt either: only prompts of 6 and 8 tokens without speculation
    # (8 of the 96 steps) reach FlashInfer as the line ran them.
    assert len(short_prompt_mismatches(results)) == 88


# ------------------------------------------------------------------ short prompts (issue 31)

# The v0.28.0 line's per-request widths for a short prefill (seed 000: 2 and 4 real first
# prefills faulted at 4 rows on GB10, 2 -> 6 ran); 0003's prefill rule pads to these.
LINE_PREFILL_WIDTHS = (1, 6, 8, 16, 24, 32, 36)
LONG = 1000


def line_prefill_rows(n: int) -> int:
    return next(w for w in LINE_PREFILL_WIDTHS if n <= w)


def expected_short_prompt_launches(config: str, prompt: int, mix: str) -> list[list]:
    """What FlashInfer must receive for one step on SM12x: the prompt in the prefill launch
    at the line's prefill width (beside the long prompt in the same chunk), the running
    requests alone in the decode launch (two 6-row verifies with DSpark, two 1-row decodes
    without); the SM120 class launches the prefill first."""
    launches = [["prefill", line_prefill_rows(prompt) + (LONG if str(LONG) in mix else 0)]]
    if "decodes" in mix:
        launches.append(["decode", 12 if config.startswith("DSpark") else 2])
    return launches


def short_prompt_table(results: dict[str, str]) -> dict:
    assert results["short prompts"] == "ok", results["short prompts"]
    return json.loads(results["short prompts: rows"])


def short_prompt_mismatches(results: dict[str, str]) -> list[str]:
    rows = short_prompt_table(results)
    bad = []
    for config, prompts in rows.items():
        for prompt, mixes in prompts.items():
            for mix, launches in mixes.items():
                want = expected_short_prompt_launches(config, int(prompt), mix)
                if launches != want:
                    bad.append(f"{config}, prompt {prompt} {mix}: {launches}, want {want}")
    return bad


def test_dspark_makes_every_prompt_up_to_11_tokens_fit_the_decode_threshold(layout_results):
    # vLLM's SWA builder with DSpark (parallel drafting): 1 + 2k = 11; without speculation 1.
    assert json.loads(layout_results["short prompts: decode thresholds"]) == {
        "DSpark k=5": 11, "no speculation": 1}


def test_short_prompts_reach_flashinfer_as_prefills_at_the_lines_widths(layout_results):
    # Prompts of 1 to 12 tokens, alone, beside two running requests, beside a 1,000-token
    # prompt and beside both, with DSpark and without: through the builders' own split
    # and the SM120 class's _forward_decode / _forward_prefill, every target layer kind.
    rows = short_prompt_table(layout_results)
    assert sorted(rows) == ["DSpark k=5", "no speculation"]
    assert all(len(prompts) == 12 and all(len(m) == 4 for m in prompts.values())
               for prompts in rows.values()), rows
    assert short_prompt_mismatches(layout_results) == []
    # The example: decodes 6 + 6, a 4-token prompt and a 1,000-token prompt.
    assert rows["DSpark k=5"]["4"]["+ 2 decodes + 1000-token prompt"] == [["prefill", 1006], ["decode", 12]]


def test_the_swa_and_c128a_splits_agree_and_count_the_prompt_as_a_prefill(layout_results):
    splits = json.loads(layout_results["short prompts: splits"])
    for config, prompts in splits.items():
        for prompt, mixes in prompts.items():
            for mix, split in mixes.items():
                decodes, prefills, decode_tokens, prefill_tokens = split["swa"]
                assert split["c128a"] == [decode_tokens, prefill_tokens], (config, prompt, mix, split)
                assert prefills == 1 + (str(LONG) in mix), (config, prompt, mix, split)
                assert decodes == 2 * ("decodes" in mix), (config, prompt, mix, split)


def test_draft_steps_and_padded_graph_batches_keep_vllms_split(layout_results):
    # The split's prefill flags are absent in DSpark's draft step and shorter than a FULL-graph
    # batch padded with empty requests: both stay all-decode, as vLLM splits them.
    guards = json.loads(layout_results["short prompts: guards"])
    draft = guards["DSpark draft, 2 requests x 5 rows"]
    assert draft["split"]["swa"] == draft["vllm's split"] == [2, 0, 10, 0]
    assert draft["launches"] == [["decode", 12]]
    padded = guards["target verify, 2 requests padded to 4"]
    assert padded["split"]["swa"] == padded["vllm's split"] == [4, 0, 24, 0]
    assert padded["split"]["c128a"] == [24, 0] and padded["launches"] == [["decode", 24]]
