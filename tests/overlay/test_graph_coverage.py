"""benchmarks/graph_coverage.py on the patched tree: which decode shapes replay a CUDA graph
(vLLM's own CudaGraphManager, target and DSpark draft) and whether b12x plans anything after
READY (vLLM's b12x warm-up and the graph capture's forwards, then every token count serving
reaches through vLLM's FusedMoEKernel, with a b12x stand-in that records plan calls).

The settings are those of tests/fixtures/cluster-two-node.toml (the template's defaults:
12 sequences, 8,192 batched tokens, DSpark k=5). One run of the tool serves every test here.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from . import b12x_contract as contract

REPO = Path(__file__).resolve().parents[2]
CLUSTER = REPO / "tests" / "fixtures" / "cluster-two-node.toml"

pytestmark = pytest.mark.skipif(
    contract.source_root() is None,
    reason="the pinned b12x sources are not installed (.ci/setup installs them)",
)


def _tool():
    from benchmarks import graph_coverage

    return graph_coverage


@pytest.fixture(scope="module")
def coverage(patched_site) -> dict:
    result = _tool().collect(CLUSTER, site=patched_site)
    assert "error" not in result, result["error"]
    return result


def test_settings_are_the_cluster_files(coverage):
    from dspark.config import validate as dc

    serving = dc.load(CLUSTER).serving
    s = coverage["settings"]
    assert (s["max_num_seqs"], s["max_num_batched_tokens"], s["num_speculative_tokens"]) == (
        serving.max_num_seqs, serving.max_num_batched_tokens, serving.num_speculative_tokens), s
    assert s["capture_sizes"], "no CUDA-graph capture sizes"


def test_every_target_verify_batch_replays_a_full_graph(coverage):
    rows = coverage["graphs"]["target"]
    assert [r["reqs"] for r in rows] == list(range(1, 13))
    bad = [r for r in rows if not (r["graph"] and r["mode"] == "FULL")]
    assert not bad, bad


def test_every_draft_batch_replays_a_full_graph(coverage):
    rows = coverage["graphs"]["draft"]
    assert [r["reqs"] for r in rows] == list(range(1, 13))
    bad = [r for r in rows if not (r["graph"] and r["mode"] == "FULL")]
    assert not bad, bad


def test_serving_reaches_every_prefill_chunk_length(coverage):
    """Beyond the largest capture size, dispatch leaves a batch at its exact length."""
    target = set(coverage["reachable"]["target"])
    largest = max(coverage["settings"]["capture_sizes"])
    assert set(range(largest + 1, coverage["settings"]["max_num_batched_tokens"] + 1)) <= target
    assert coverage["reachable"]["draft"], "the DSpark draft reaches no token count"


def test_no_b12x_plan_after_ready(coverage):
    b = coverage["b12x"]
    late = {role: sorted(int(t) for t in counts) for role, counts in b["late"].items()}
    assert b["plan_calls_after_ready"] == 0, (
        f"{b['plan_calls_after_ready']} plan calls after READY; target counts "
        f"{late['target'][:20]}..., draft counts {late['draft']}")


def test_the_overlays_bucket_is_b12xs(patched_site):
    """The experts' token bucket is the pinned b12x's route_pack_token_capacity."""
    host = contract.source_root() / "b12x" / "moe" / "_shared" / "kernels" / "w4a16" / "host.py"
    tree = ast.parse(host.read_text())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef)
              and n.name == "route_pack_token_capacity")
    ns: dict = {}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), str(host), "exec"), ns)
    src = (patched_site / "vllm" / "model_executor" / "layers" / "fused_moe" / "experts"
           / "b12x_mxfp4_moe.py").read_text()
    mine = next(n for n in ast.parse(src).body if isinstance(n, ast.FunctionDef)
                and n.name == "b12x_token_bucket")
    exec(compile(ast.Module(body=[mine], type_ignores=[]), "b12x_mxfp4_moe.py", "exec"), ns)
    for m in range(1, 9000):
        assert ns["b12x_token_bucket"](m) == ns["route_pack_token_capacity"](m, 6), m


def test_tool_help():
    r = subprocess.run([sys.executable, "-m", "benchmarks.graph_coverage", "--help"], capture_output=True,
                       text=True, timeout=60, cwd=REPO)
    assert r.returncode == 0 and "cluster file" in r.stdout and "--grid" in r.stdout, r.stderr
    # Neither a cluster file nor --grid, or both: a usage error (exit 2), nothing run.
    for args in ([], ["--grid", str(CLUSTER)]):
        r = subprocess.run([sys.executable, "-m", "benchmarks.graph_coverage", *args], capture_output=True,
                           text=True, timeout=60, cwd=REPO)
        assert r.returncode == 2 and "--grid" in r.stderr, (args, r.returncode, r.stderr)
