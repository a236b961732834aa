"""DSpark's draft steps replay its CUDA graphs: vLLM's own graph manager, built by
the (patched) speculator, dispatching the speculator's real per-request token
count (graph_dispatch_checks.py, in a subprocess per tree)."""

from __future__ import annotations

from pathlib import Path

import pytest

from .conftest import run_checks

CHECKS = Path(__file__).with_name("graph_dispatch_checks.py")
BATCHES = [str(n) for n in range(1, 13)]


@pytest.fixture(scope="module")
def dispatch(patched_site) -> dict:
    return run_checks(patched_site, CHECKS, timeout=600)


def test_every_draft_batch_replays_a_full_graph(dispatch):
    # DSpark drafts k=5 query tokens per request (sample_from_anchor); every
    # batch of 1..max_num_seqs requests must find a FULL graph it can replay.
    assert dispatch["draft q_len"] == 5
    assert dispatch["draft"] == {n: "FULL" for n in BATCHES}, dispatch["draft"]


def test_draft_graphs_are_captured_in_whole_draft_blocks(dispatch):
    # What the manager captures is what dispatch can replay: whole blocks of
    # the draft's 5 query tokens, none larger than 12 requests' worth.
    counts = dispatch["draft captured token counts"]
    assert counts and all(n % 5 == 0 and n <= 60 for n in counts), counts


def test_stock_vllm_replays_the_same_draft_graphs(stock_site):
    # The overlay must not take away what stock vLLM 0.28.0 already replays.
    stock = run_checks(stock_site, CHECKS, timeout=600)
    assert stock["draft"] == {n: "FULL" for n in BATCHES}, stock["draft"]
