"""`dspark local up --nodes N`: the node counts the tiny model can be split over are taken, the
others refused before anything is written or started (no pair needed)."""

from __future__ import annotations

import pytest

from dspark.config import validate as C
from dspark.local import cluster as L
from tests.harness.pair import run_dspark


@pytest.mark.parametrize("nodes", ["0", "1", "3", "5", "8"])
def test_a_node_count_the_tiny_model_cannot_take_is_refused_with_the_reason(tmp_path, nodes):
    r = run_dspark("local", "up", "--nodes", nodes, "--dir", str(tmp_path / "w"))
    assert r.returncode == 2, r.stdout + r.stderr
    assert "4 attention heads" in r.stderr and "choose one of 2, 4" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "w").exists()


def test_the_valid_counts_divide_the_models_heads():
    assert L.valid_node_counts() == [2, 4]


@pytest.mark.parametrize("nodes", [2, 4])
def test_the_cluster_of_n_nodes_has_one_rank_per_loopback_address_and_tp_n(tmp_path, nodes):
    cluster = C.load(L.prepare(tmp_path, L.LocalPorts(api=18000, master=18001, agent=18002), nodes=nodes))
    assert [(n.name, n.rank, n.address) for n in cluster.nodes] == [
        (L.node_name(r), r, f"127.0.0.{r + 1}") for r in range(nodes)]
    assert cluster.head.name == L.HEAD_NAME and cluster.workers[0].name == L.WORKER_NAME
    assert cluster.serving.tensor_parallel_size == nodes and cluster.serving.pipeline_parallel_size == 1
    # The machine's memory is shared out among the nodes.
    assert cluster.serving.usable_memory_gib == L.memory_per_node_gib(nodes)
    assert (tmp_path / "model" / "tokenizer.json").exists() and not cluster.serving.skip_tokenizer_init
