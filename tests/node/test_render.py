"""Rendering: golden head and worker launches, and the seed's command line reproduced."""

import json
import shlex
from pathlib import Path

import pytest

from dspark.config import validate as C
from dspark.config.schema import GIB
from dspark.config.secret_policy import REDACTED
from dspark.node.launch import API_GUARD_DIR, Launch, render
from tests.harness.pair import run_dspark

TESTS = Path(__file__).parents[1]
FIXTURE = TESTS / "fixtures" / "cluster-two-node.toml"

# The seed's rank-0 command line (shared/reference/deepseek-v4-flash.md), head address filled in.
SEED_HEAD = """serve M --served-model-name N --host H --port 8888 --trust-remote-code
--tensor-parallel-size 2 --pipeline-parallel-size 1 --kv-cache-dtype nvfp4_ds_mla
--block-size 256 --max-model-len 350000 --max-num-seqs 12 --max-num-batched-tokens 8192
--max-cudagraph-capture-size 72 --gpu-memory-utilization 0.78 --enable-prefix-caching
--async-scheduling --enable-chunked-prefill
--speculative-config {"method":"dspark","num_speculative_tokens":5,"draft_sample_method":"probabilistic"}
--tokenizer-mode deepseek_v4 --distributed-executor-backend mp --moe-backend flashinfer_b12x
--tool-call-parser deepseek_v4 --enable-auto-tool-choice --reasoning-parser deepseek_v4
--generation-config vllm --nnodes 2 --node-rank 0 --master-addr 192.168.100.10 --master-port 25000"""


def flags(argv: list[str]) -> dict[str, str | None]:
    """--flag -> value (None for switches), parsed from an argv."""
    out: dict[str, str | None] = {}
    for i, a in enumerate(argv):
        if a.startswith("--"):
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            out[a] = None if nxt is None or nxt.startswith("--") else nxt
    return out


@pytest.fixture
def cluster():
    return C.load(FIXTURE)


@pytest.mark.parametrize("node", ["spark-a", "spark-b"])
def test_golden(node):
    r = run_dspark("render", "--config", str(FIXTURE), "--node", node)
    assert r.returncode == 0, r.stderr
    # The API guard's directory is where this checkout (or the installed dspark) is.
    assert r.stdout.replace(str(API_GUARD_DIR), "@API_GUARD_DIR@") == \
        (TESTS / "golden" / f"render-{node}.txt").read_text()


def test_head_reproduces_the_seed_command_line(cluster):
    """The seed's line, but for the defaults that depart from it, each with its source in
    config.ServingConfig: MiaAI-Lab's utilization and long-prefill threshold, and
    capture sizes in multiples of the 6 verify rows of a request, with the draft's sizes that
    none of them covers (vLLM takes the largest, 72, as the maximum)."""
    launch = render(cluster, cluster.head)
    got = flags(launch.argv)
    want = flags(SEED_HEAD.split())
    want["--served-model-name"] = "deepseek-v4-flash"
    want["--host"] = "192.168.100.10"  # the API binds the fabric address unless told otherwise
    del want["--max-cudagraph-capture-size"]
    want.update({"--gpu-memory-utilization": "0.835", "--long-prefill-token-threshold": "1024",
                 "--cudagraph-capture-sizes": "5"})
    want["--shutdown-timeout"] = "60"  # a planned stop drains (supervisor.drain_s)
    # The API key on every route but /health, and no browser origin (tests/node/test_api_guard.py).
    want.update({"--middleware": "dspark_api_guard.GuardEveryRoute", "--allowed-origins": "[]"})
    assert got == want
    # Every multiple of the 6 verify rows up to 12 requests, and the DSpark draft's 5 and 35
    # tokens (1 and 7 requests of 5), which no multiple of 6 rounds to in its graph manager.
    sizes = launch.argv.index("--cudagraph-capture-sizes")
    got_sizes = [int(a) for a in launch.argv[sizes + 1:sizes + 15]]
    assert got_sizes == sorted([6 * n for n in range(1, 13)] + [5, 35])
    assert launch.env["VLLM_USE_BREAKABLE_CUDAGRAPH"] == "0"


def test_worker_is_headless_and_has_no_api(cluster):
    w = render(cluster, cluster.node("spark-b"))
    f = flags(w.argv)
    assert "--headless" in f and "--host" not in f and "--port" not in f
    assert (f["--node-rank"], f["--master-addr"], f["--nnodes"]) == ("1", "192.168.100.10", "2")
    # fabric settings come from the worker's own entry
    assert w.env["VLLM_HOST_IP"] == "192.168.100.11"
    assert w.env["NCCL_SOCKET_IFNAME"] == w.env["GLOO_SOCKET_IFNAME"] == "enP2p1s0f0np0"
    assert w.env["NCCL_IB_HCA"] == "roceP2p1s0f0" and w.env["NCCL_IB_GID_INDEX"] == "3"


def test_kv_cache_bytes_replaces_the_utilization(cluster):
    import dataclasses

    s = dataclasses.replace(cluster.serving, kv_cache_memory_bytes=12 * GIB)
    f = flags(render(dataclasses.replace(cluster, serving=s), cluster.head).argv)
    assert f["--kv-cache-memory-bytes"] == str(12 * GIB) and "--gpu-memory-utilization" not in f


def test_secrets_redacted_and_shell_output_round_trips():
    launch = Launch(argv=["vllm", "serve", "m", "--speculative-config", '{"a": 1}'],
                    env={"VLLM_API_KEY": "sk-secret", "VLLM_HOST_IP": "10.0.0.1"})
    text = launch.shell()
    assert "sk-secret" not in text and f"VLLM_API_KEY={shlex.quote(REDACTED)}" in text
    words = [w for w in shlex.split(text.replace("\\\n", " ")) if "=" not in w or w.startswith("{")]
    assert words == launch.argv


def test_json_output(cluster):
    r = run_dspark("render", "--config", str(FIXTURE), "--node", "spark-a", "--json")
    data = json.loads(r.stdout)
    assert data["argv"] == render(cluster, cluster.head).argv and data["env"]["VLLM_HOST_IP"] == "192.168.100.10"


def test_unknown_node_is_a_clear_error():
    r = run_dspark("render", "--config", str(FIXTURE), "--node", "spark-z")
    assert r.returncode == 2 and "no node named 'spark-z'" in r.stderr and "Traceback" not in r.stderr
