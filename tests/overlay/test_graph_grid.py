"""Every decode batch in a CUDA graph for any max_num_seqs S (1..64) and k (1..7), on every line.

For each grid point dspark's capture sizes (``ServingConfig.capture_sizes``, what render passes
as --cudagraph-capture-sizes) go through vLLM's own ``_set_cudagraph_sizes``, the target's
``CudaGraphManager`` and the draft's from ``DSparkSpeculator.init_cudagraph_manager``, and every
batch of 1..S requests through ``dispatch_cg_and_sync_dp`` (graph_grid_checks.py: one subprocess
per line, every case in it). The same run proves dspark's pure model of that dispatch
(dspark.engine.graph_dispatch, which ``dspark config check`` uses) on other lists: the former rule
(multiples of k + 1 only), vLLM 0.28.0's own default list given explicitly, and dspark's list
under a user's max_cudagraph_capture_size of half the verify rows.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dspark.config.schema import ServingConfig
from dspark.engine import graph_dispatch as G

from .conftest import LINE_032, run_checks

CHECKS = Path(__file__).with_name("graph_grid_checks.py")
GRID = [(s, k) for s in range(1, 65) for k in range(1, 8)]
# The model's proof on other lists takes every k and a third of the S (every remainder of S - 1
# by k + 1 still appears), to keep the run short.
PROOF_GRID = [(s, k) for s, k in GRID if s % 3 == 1 or s <= 16]
MNBT = 8192


def _tool():
    from benchmarks import graph_coverage

    return graph_coverage
LINES = {"v0.28.0": "0.28.0", LINE_032: "0.32.0"}


def dspark_sizes(s: int, k: int, **more) -> list[int]:
    serving = ServingConfig(max_num_seqs=s, speculative_config={"method": "dspark", "num_speculative_tokens": k},
                              **more)
    sizes = serving.capture_sizes
    assert sizes is not None
    return sizes


def vllm_default_list(top: int) -> list[int]:
    """vLLM 0.28.0's default capture list up to ``top`` (1, 2, 4, then every 8)."""
    return [x for x in [1, 2, 4, *range(8, 256, 8)] if x <= top] or [top]


def cases() -> list[dict]:
    """benchmarks/graph_coverage.py's grid (dspark's list now, the former rule before), and
    more lists for the model's proof."""
    out = _tool().grid_cases()
    assert {(c["S"], c["k"]) for c in out} == set(GRID) and {c["kind"] for c in out} == {"now", "before"}
    for s, k in PROOF_GRID:
        rows = s * (k + 1)
        for kind, sizes in (("vllm list", vllm_default_list(rows)),
                            ("half", dspark_sizes(s, k, max_cudagraph_capture_size=max(1, rows // 2)))):
            out.append({"S": s, "k": k, "kind": kind, "sizes": sizes, "max": None, "mnbt": MNBT})
    return out


@pytest.fixture(scope="module", params=list(LINES))
def grid(request, tmp_path_factory) -> tuple[str, list[dict], list[dict]]:
    line = request.param
    if line == LINE_032:
        site, python = request.getfixturevalue("patched_site_032"), request.getfixturevalue("python_032")
    else:
        import sys

        site, python = request.getfixturevalue("patched_site"), sys.executable
    todo = cases()
    path = tmp_path_factory.mktemp("grid") / "cases.json"
    path.write_text(json.dumps(todo))
    got = run_checks(site, CHECKS, str(path), timeout=600, python=python)
    assert len(got) == len(todo)
    return LINES[line], todo, got


def _of(grid, kind):
    _, todo, got = grid
    return [(c, g) for c, g in zip(todo, got, strict=True) if c["kind"] == kind]


def test_every_verify_and_draft_batch_replays_a_full_graph_of_its_own_size(grid):
    bad = []
    for case, got in _of(grid, "now"):
        assert got["draft q_len"] == case["k"]  # DSpark drafts k query tokens a request
        q = {"target": case["k"] + 1, "draft": case["k"]}
        for role in ("target", "draft"):
            for n, (mode, tokens) in enumerate(got[role], 1):
                if (mode, tokens) != ("FULL", n * q[role]):
                    bad.append((case["S"], case["k"], role, n, mode, tokens))
    assert not bad, f"{len(bad)} batches not in a FULL graph of their own size, e.g. {bad[:10]}"


def test_the_former_list_left_the_last_draft_batch_eager(grid):
    """Multiples of k + 1 only: when k + 1 divides S - 1, no size rounds into the draft's last
    block, and the batch of S requests ran eager (the failing case the fix is for)."""
    before = {(c["S"], c["k"]): g for c, g in _of(grid, "before")}
    for s, k in [(13, 5), (7, 5), (19, 5), (25, 5), (13, 3), (17, 3), (9, 7), (17, 7), (25, 7)]:
        assert before[s, k]["draft"][-1] == ["NONE", s * k], (s, k)
    full = sum(all(m == "FULL" for m, _ in g["draft"]) for _, g in _of(grid, "before"))
    assert full == 336  # of 448 grid points, the same on both lines


def test_the_added_sizes_leave_every_verify_batch_as_it_was(grid):
    """The draft's extra sizes change no target verify dispatch: the same FULL graph of the same
    rows as under multiples of k + 1 alone, and the same largest capture size."""
    before = {(c["S"], c["k"]): g for c, g in _of(grid, "before")}
    for case, got in _of(grid, "now"):
        old = before[case["S"], case["k"]]
        assert got["target"] == old["target"], (case["S"], case["k"])
        assert max(got["sizes"]) == max(old["sizes"]), (case["S"], case["k"])
        # The cost: one PIECEWISE target graph and at most one FULL draft graph per added size.
        added = len(got["sizes"]) - len(old["sizes"])
        assert got["graphs"]["target"] == old["graphs"]["target"] + added
        assert got["graphs"]["draft"] <= old["graphs"]["draft"] + added


def test_dsparks_model_is_vllms_dispatch(grid):
    """dspark.engine.graph_dispatch (what `dspark config check` judges with) gives vLLM's own sizes and,
    for every batch of every case, vLLM's mode and padded tokens."""
    vllm, todo, got = grid
    wrong = []
    for case, real in zip(todo, got, strict=True):
        sizes = G.vllm_sizes(case["sizes"], case["max"], max_num_seqs=case["S"],
                             max_num_batched_tokens=case["mnbt"])
        assert sizes == real["sizes"], case
        model = G.coverage(sizes, case["S"], case["k"], case["k"], vllm)
        for role in ("target", "draft"):
            mine = [[b.mode, b.padded] for b in model[role]]
            if mine != real[role]:
                wrong.append((case["kind"], case["S"], case["k"], role))
    assert not wrong, f"{len(wrong)} cases differ, e.g. {wrong[:10]}"
    # The proof covers every outcome: exact, padded FULL, PIECEWISE and NONE.
    seen = {(m, t == (n + 1) * (c["k"] + 1))
            for c, g in zip(todo, got, strict=True) for n, (m, t) in enumerate(g["target"])}
    seen |= {(m, t == (n + 1) * c["k"])
             for c, g in zip(todo, got, strict=True) for n, (m, t) in enumerate(g["draft"])}
    assert {("FULL", True), ("FULL", False), ("NONE", True)} <= seen, seen
    if vllm == "0.28.0":
        assert any(m == "PIECEWISE" for m, _ in seen), seen


def test_the_tools_grid_report(grid):
    """benchmarks/graph_coverage.py --grid's figures from the same cases: before, 336 of the 448
    points had every draft batch FULL and none had all of them exact; now all 448 are exact."""
    tool = _tool()
    _, todo, got = grid
    mine = [(c, g) for c, g in zip(todo, got, strict=True) if c["kind"] in ("now", "before")]
    result = {"line": "x", "cases": [c for c, _ in mine], "results": [g for _, g in mine]}
    summary = tool.grid_summary(result)
    assert summary["before"]["draft"] == {"exact": 0, "padded": 336, "eager": 112}, summary
    assert summary["now"]["draft"] == summary["now"]["target"] == {"exact": 448, "padded": 0, "eager": 0}
    assert summary["before"]["target"]["exact"] == 448
    assert tool.grid_goal_met(result)
    report = tool.grid_report(result)
    assert "  k=5 xpppppxpppppx" in report and "  k=5 " + "." * 64 in report, report
