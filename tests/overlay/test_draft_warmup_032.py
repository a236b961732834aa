"""0014 (runtime line v0.32.0, new on the line): vLLM 0.32.0's own b12x warm-up
(model_executor/warmup/b12x_warmup.py b12x_warmup, which kernel_warmup runs before graph capture)
warms the DSpark draft model's b12x units beside the target's.

draft_warmup_032_checks.py runs the function in the line's Python on the stock and on the patched
0.32.0 tree, for a worker whose target and draft hold MoE layers carrying vLLM's own b12x provider
(B12xExperts with the checkpoint's expert shapes and vLLM's MXFP4 W4A16 quant config; b12x itself,
the GPU and the SM12x capability stand in, as that script says), with the capture sizes and token
budget dspark renders for the template cluster on this line (DSpark k=5, 12 sequences).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .conftest import run_checks

CHECKS = Path(__file__).with_name("draft_warmup_032_checks.py")
WARMED = "Warmed up 1 b12x MoE kernel signature(s)"


@pytest.fixture(scope="module")
def rendered(rendered_032) -> dict:
    return rendered_032


def _run(site: Path, python, rendered: dict) -> dict:
    results = run_checks(site, CHECKS, json.dumps(rendered["sizes"]), str(rendered["max_batched"]),
                         python=python)
    assert Path(results["b12x_warmup"]).resolve().is_relative_to(site.resolve()), results["b12x_warmup"]
    failed = {name: r for name, r in results.items() if isinstance(r, str) and name != "b12x_warmup"}
    assert not failed, "\n".join(failed.values())
    return results


@pytest.fixture(scope="module")
def stock(stock_site_032, python_032, rendered) -> dict:
    return _run(stock_site_032, python_032, rendered)


@pytest.fixture(scope="module")
def patched(patched_site_032, python_032, rendered) -> dict:
    return _run(patched_site_032, python_032, rendered)


def test_stock_032_warms_the_target_only(stock):
    """The gap 0014 closes: a draft whose MoE experts are not the target's is never warmed."""
    run = stock["draft of its own shape"]
    assert run["compiled"] == ["target"], run
    assert run["logged"] == [f"{WARMED}."]


def test_the_patched_warm_up_compiles_the_drafts_own_units(patched):
    run = patched["draft of its own shape"]
    assert run["compiled"] == ["target", "draft"], run
    assert run["logged"] == [f"{WARMED} for the target model.", f"{WARMED} for the draft model."]


def test_a_unit_the_target_and_the_draft_share_compiles_once(patched, stock):
    """DeepSeek-V4-Flash's case: the draft's layers are of the target's config, so their unit's key
    is the target's: one compile (the target's four layers and the draft's three are one unit), as
    on stock, and the log says the draft's was the target's."""
    run = patched["draft of the target's shape"]
    assert run["compiled"] == stock["draft of the target's shape"]["compiled"] == ["target"], run
    assert run["logged"] == [f"{WARMED} for the target model.",
                             "1 b12x kernel signature(s) of the draft model are the target model's, warmed once."]


def test_without_a_draft_the_warm_up_is_upstreams(patched, stock, rendered):
    """The target alone, as upstream; its counts are upstream's (1, the sizes, the budget) and,
    with 0015, every count up to the budget besides."""
    run = patched["no draft"]
    upstream = stock["no draft"]["counts"]["target"]
    assert upstream == sorted({1, rendered["max_batched"], *rendered["sizes"]})
    assert run["compiled"] == ["target"] and run["counts"]["target"] == list(range(1, rendered["max_batched"] + 1))
    assert set(upstream) <= set(run["counts"]["target"])
    assert run["logged"] == [f"{WARMED} for the target model."]


def test_the_drafts_units_get_dsparks_draft_batches(patched, rendered):
    """The draft's units get the same token counts as the target's: every count up to the budget
    (0015), so 1, the budget and every capture size dspark renders, among them the n x k draft
    batches no multiple of k + 1 covers (5 and 35 for k=5 and 12 sequences:
    dspark.engine.graph_dispatch.covering_sizes)."""
    k, sizes = rendered["k"], rendered["sizes"]
    draft_batches = [s for s in sizes if s % (k + 1)]
    assert k == 5 and draft_batches == [5, 35] and all(s % k == 0 for s in draft_batches)
    counts = patched["draft of its own shape"]["counts"]
    # Every count up to the budget (0015), so upstream's and the draft batches among them.
    assert counts["draft"] == counts["target"] == list(range(1, rendered["max_batched"] + 1))
    assert set(draft_batches) | {1, rendered["max_batched"], *sizes} <= set(counts["draft"])


def test_off_sm12x_nothing_is_warmed_on_either_tree(patched, stock):
    """The CUDA / SM12x guards of the function stand as upstream wrote them."""
    assert patched["off SM12x"] == stock["off SM12x"] == {"compiled": [], "counts": {}, "logged": []}
