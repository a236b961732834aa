"""b12x warm-up coverage on runtime line v0.32.0 (issue 32): which b12x 1.5.1 MoE kernel
signatures vLLM 0.32.0's warm-up compiles before READY, and which token counts serving reaches
whose signature it did not.

coverage_032_checks.py runs the patched tree's b12x_warmup (0014 included) and B12xExperts'
own deduplication in the line's Python, with the signature b12x 1.5.1's own lowering gives each
token count (make_moe_spec, lower_moe_execution, select_route_block_size_m from the pinned
wheel's sources; the glue of plan_tp_moe_execution, whose module imports CUDA, stands in, as that
script says), at the settings dspark renders for tests/fixtures/cluster-two-node.toml on this
line (8,192 batched tokens, capture sizes up to 72, DSpark k=5, 12 sequences).

On stock vLLM 0.32.0 the figure is not zero: vLLM hands the warm-up 1, the capture sizes and
max_num_batched_tokens, trusting b12x to deduplicate; b12x's W4A16 policy picks a route block of
8, 16, 32, 48 or 64 rows from the average routes per expert (6m/256 below 0.9 x block), so the
warm-up compiles two signatures (block 8 for 1..307 tokens, block 64 for 1,844..8,192) and the
eager prefill chunks of 308 to 1,843 tokens select three signatures first compiled after READY
(blocks 16, 32, 48). The line's 0015 hands the warm-up every count 1..budget: five signatures
compiled before READY, none after. Every verify (n x 6) and draft (n x 5) batch is on the
warmed block-8 signature.

Not established here: whether b12x, on a GPU, compiles anything for a new token count inside a
warmed signature (vLLM plans every new count afresh: 8,176 plans after READY), nor the kernel
compiles themselves (CuTe DSL).
"""

from __future__ import annotations

import ast
import json
import os
from pathlib import Path

import pytest

from .conftest import REPO, run_checks

pytestmark = pytest.mark.vllm

CHECKS = Path(__file__).with_name("coverage_032_checks.py")
LINE_LOCK = REPO / "nix" / "lines" / "v0.32.0" / "runtime-lock.json"
SIG = "w4a16/materialized_persistent/route_block_rows={}"


def b12x_source() -> Path | None:
    """The line's pinned b12x wheel, unpacked as .ci/setup unpacks the v0.28.0 line's
    (.venv/pinned/b12x-VERSION), or where DSPARK_B12X_032_SOURCE names."""
    named = os.environ.get("DSPARK_B12X_032_SOURCE")
    if named:
        root = Path(named)
    else:
        lock = json.loads(LINE_LOCK.read_text())
        version = next(p["version"] for p in lock["packages"] if p["name"] == "b12x")
        root = REPO / ".venv" / "pinned" / f"b12x-{version}"
    return root if (root / "b12x" / "moe" / "_shared" / "execution.py").is_file() else None


@pytest.fixture(scope="module")
def rendered(rendered_032) -> dict:
    return rendered_032


def _coverage(site: Path, python, rendered: dict) -> dict:
    src = b12x_source()
    if src is None:
        pytest.skip("the v0.32.0 line's pinned b12x 1.5.1 sources are not unpacked (.venv/pinned/b12x-1.5.1 "
                    "or DSPARK_B12X_032_SOURCE)")
    r = rendered
    results = run_checks(site, CHECKS, str(src), json.dumps(r["sizes"]), str(r["max_batched"]),
                         str(r["k"]), str(r["max_seqs"]), python=python)
    assert "error" not in results, results["error"]
    assert Path(results["b12x_warmup"]).resolve().is_relative_to(site.resolve())
    return results


@pytest.fixture(scope="module")
def coverage(patched_site_032, python_032, rendered) -> dict:
    """The line's tree: its series, 0014 and 0015 included."""
    return _coverage(patched_site_032, python_032, rendered)


@pytest.fixture(scope="module")
def coverage_stock(stock_site_032, python_032, rendered) -> dict:
    """Stock vLLM 0.32.0: upstream's warm-up counts."""
    return _coverage(stock_site_032, python_032, rendered)


def test_the_settings_are_the_templates(rendered):
    assert (rendered["max_batched"], rendered["k"], rendered["max_seqs"]) == (8192, 5, 12)
    assert max(rendered["sizes"]) == 72


def test_the_policy_read_is_b12x_151s(coverage):
    assert coverage["policy"] == {"routed_sizes": [8, 16, 32, 48, 64], "target_fill": 0.9}


def test_stock_warm_up_compiles_two_signatures(coverage_stock, rendered):
    """vLLM's warm-up counts (1, the capture sizes, the budget) deduplicate to two launches."""
    c = coverage_stock
    assert c["warmup_counts"] == sorted({1, rendered["max_batched"], *rendered["sizes"]})
    assert c["compiled_launch_counts"] == [1, 8192]
    assert c["warmed_signatures"] == sorted([SIG.format(64), SIG.format(8)])


def test_on_stock_three_signatures_are_first_compiled_after_ready(coverage_stock):
    """THE FINDING on stock 0.32.0: eager prefill chunks of 308..1,843 tokens (1,536 counts) select
    route blocks of 16, 32 and 48 rows, which no warm-up count selects."""
    c = coverage_stock
    assert c["signatures_after_ready"] == {
        SIG.format(16): [[308, 614]], SIG.format(32): [[615, 1228]], SIG.format(48): [[1229, 1843]]}
    assert c["late_token_counts"] == 1536
    assert c["reach"][SIG.format(8)] == [[1, 307]]
    assert c["reach"][SIG.format(64)] == [[1844, 8192]]


def test_with_0015_every_signature_serving_reaches_is_compiled_before_ready(coverage, rendered):
    """The line: the warm-up gets every count 1..budget, launches one per signature (five), and
    nothing is first compiled after READY."""
    assert coverage["warmup_counts"] == list(range(1, rendered["max_batched"] + 1))
    assert coverage["warmed_signatures"] == sorted(SIG.format(b) for b in (8, 16, 32, 48, 64))
    assert len(coverage["compiled_launch_counts"]) == 5
    assert coverage["signatures_after_ready"] == {} and coverage["late_token_counts"] == 0


def test_every_verify_and_draft_batch_is_on_a_warmed_signature(coverage):
    assert coverage["verify_signatures"] == coverage["draft_signatures"] == [SIG.format(8)]


def test_vllm_plans_every_new_count_after_ready(coverage, coverage_stock, rendered):
    """vLLM's B12xExperts._plan caches by exact count: every count but those launched before READY
    (the warm-up's launches and the capture sizes) gets a fresh b12x plan after READY, on stock
    (8,176) and on the line (8,173: 0015's three new launches are planned before READY). A plan
    of a warmed signature is b12x's own business on a GPU (not established here)."""
    before = {1, rendered["max_batched"], *rendered["sizes"]}
    assert coverage_stock["plans_after_ready"] == rendered["max_batched"] - len(before) == 8176
    assert coverage["plans_after_ready"] == 8176 - 3


def test_the_stand_in_glue_is_b12xs_w4a16_branch():
    """The lines of b12x's plan_tp_moe_execution the checks script stands in for: in W4A16 mode
    the token count reaches the execution plan only through select_route_block_size_m."""
    src = b12x_source()
    if src is None:
        pytest.skip("the v0.32.0 line's pinned b12x 1.5.1 sources are not unpacked")
    impl = src / "b12x" / "moe" / "fused_moe" / "_impl.py"
    fn = next(n for n in ast.parse(impl.read_text()).body
              if isinstance(n, ast.FunctionDef) and n.name == "plan_tp_moe_execution")
    text = ast.unparse(fn)
    assert "route_block_rows = select_route_block_size_m(num_tokens, num_topk, weight_E)" in text
    assert "regime = MoERegime.MATERIALIZED_PERSISTENT" in text
    assert "execution = lower_moe_execution(spec, regime=regime, tile_m=dynamic_tile_m" in text
    layout = next(n for n in ast.parse(impl.read_text()).body
                  if isinstance(n, ast.FunctionDef) and n.name == "_resolve_workspace_layout")
    assert "raise RuntimeError('W4A16 policy did not resolve the W4A16 family')" in ast.unparse(layout)
