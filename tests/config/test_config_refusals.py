"""A closed API by default, every secret path closed, and the validation
gaps refused, each through the real CLI in-process (`dspark config check`, `dspark render`,
`dspark check --no-peers`) with a message naming the field; validation linear in the node
count."""

from __future__ import annotations

import contextlib
import gc
import socket
import time
import tomllib
from pathlib import Path

import pytest
from click.testing import CliRunner

from dspark.cli.main import main
from dspark.config import checks, command_line
from dspark.config import validate as C
from dspark.config.flags import DSPARK_FLAGS
from dspark.config.schema import GIB, Cluster, ConfigError, ModelConfig, NodeConfig
from dspark.config.template import dumps, template

FIXTURE = Path(__file__).parents[1] / "fixtures" / "cluster-two-node.toml"
WILDCARDS = ("0.0.0.0", "::")


def good() -> dict:
    return tomllib.loads(FIXTURE.read_text())


def invoke(*args: str, env: dict | None = None):
    r = CliRunner().invoke(main, list(args), env=env)
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    return r


def config_check(tmp_path: Path, data: dict):
    path = tmp_path / "cluster.toml"
    path.write_text(dumps(data))
    return path, invoke("config", "check", "--config", str(path))


def refused(tmp_path: Path, data: dict, needle: str) -> str:
    path, r = config_check(tmp_path, data)
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output and needle in r.output, r.output
    return r.output


# ------------------------------------------------------------------- item 6: secrets
def _spec(**extra):
    return {"method": "dspark", "num_speculative_tokens": 5, **extra}


SECRET_CASES = [
    ("model", "served_name", "--api-key=sk-21a", "model.served_name"),
    ("model", "path", "--api-key=sk-21b", "model.path"),
    ("model", "served_name", "-sk-21c", "model.served_name"),
    ("serving", "speculative_config", _spec(api_key="sk-21d"), "serving.speculative_config.api_key"),
    ("serving", "speculative_config", _spec(draft={"hf_token": "sk-21e"}), "serving.speculative_config.draft.hf_token"),
    ("serving", "speculative_config", _spec(**{"api-key": "sk-21f"}), "serving.speculative_config.api-key"),
    ("serving", "speculative_config", _spec(password="sk-21g"), "serving.speculative_config.password"),
]


@pytest.mark.parametrize("section, key, value, needle", SECRET_CASES)
def test_secret_paths_are_refused_and_never_printed(tmp_path, section, key, value, needle):
    data = good()
    data[section][key] = value
    secret = next(s for s in ("sk-21a", "sk-21b", "sk-21c", "sk-21d", "sk-21e", "sk-21f", "sk-21g") if s in str(value))
    out = refused(tmp_path, data, needle)
    assert secret not in out, out  # the refusal names the field, never the value
    r = invoke("render", "--config", str(tmp_path / "cluster.toml"), "--node", "spark-a")
    assert r.exit_code == 2 and "Traceback" not in r.output and secret not in r.output, r.output


def test_ordinary_speculative_config_still_passes(tmp_path):
    data = good()
    data["serving"]["speculative_config"] = _spec(draft_sample_method="probabilistic", model="/m/draft",
                                                  draft_tensor_parallel_size=1)
    path, r = config_check(tmp_path, data)
    assert r.exit_code == 0, r.output


# ------------------------------------------------------------------- item 7: validation gaps
def _node(i: int, **kw):
    def mutate(data):
        data["nodes"][i].update(kw)
    return mutate


def _serving(**kw):
    def mutate(data):
        data["serving"].update(kw)
    return mutate


def _supervisor(**kw):
    def mutate(data):
        data.setdefault("supervisor", {}).update(kw)
    return mutate


def _same_machine_ipv6(data):
    data["nodes"][0].update(address="::1", agent_port=8890)
    data["nodes"][1].update(address="0:0:0:0:0:0:0:1", agent_port=8890)


GAPS = [
    # gid_index: ASCII digits only
    (_node(1, gid_index="²"), "nodes[1] (spark-b).gid_index"),
    (_node(1, gid_index="٣"), "nodes[1] (spark-b).gid_index"),
    (_node(1, gid_index="３"), "nodes[1] (spark-b).gid_index"),
    (_node(1, gid_index=""), "nodes[1] (spark-b).gid_index"),
    # addresses that are no node's
    (_node(1, address="0.0.0.0"), "nodes[1] (spark-b).address"),
    (_node(1, address="255.255.255.255"), "nodes[1] (spark-b).address"),
    (_node(1, address="224.0.0.1"), "nodes[1] (spark-b).address"),
    (_node(0, address="::"), "nodes[0] (spark-a).address"),
    (_node(0, address="ff02::1"), "nodes[0] (spark-a).address"),
    # ports compared by address, not by spelling
    (_same_machine_ipv6, "port 8890 is used twice"),
    # agent_host: an address or a host name
    (_node(1, agent_host="evil.example/x?"), "nodes[1] (spark-b).agent_host"),
    (_node(1, agent_host="a b"), "nodes[1] (spark-b).agent_host"),
    (_node(1, agent_host=""), "nodes[1] (spark-b).agent_host"),
    (_node(1, agent_host="x" * 300), "nodes[1] (spark-b).agent_host"),
    # node names: printable, nothing invisible
    (_node(1, name=""), "nodes[1]"),
    (_node(1, name="spark\u200bb"), "nodes[1]"),
    (_node(1, name="spark\u202eb"), "nodes[1]"),
    (_node(1, name="spark\tb"), "nodes[1]"),
    (_node(1, name=" "), "nodes[1]"),
    (_node(1, name="\u2028"), "nodes[1]"),
    # the command line
    (_serving(vllm_command=[]), "serving.vllm_command"),
    (_serving(vllm_command=["vllm", "x" * 200_000]), "serving.vllm_command"),
    (_serving(extra_args=["--x=" + "y" * 5000]), "serving.extra_args"),
    # flags dspark sets itself
    (_serving(extra_args=["--node-rank", "3"]), "serving.extra_args: --node-rank"),
    (_serving(extra_args=["--master-addr=10.0.0.1"]), "serving.extra_args: --master-addr"),
    (_serving(extra_args=["--master-port", "1"]), "serving.extra_args: --master-port"),
    (_serving(extra_args=["--enforce-eager", "--host", "0.0.0.0"]), "serving.extra_args: --host"),
    (_serving(extra_args=["--port=1"]), "serving.extra_args: --port"),
    (_serving(extra_args=["--nnodes", "9"]), "serving.extra_args: --nnodes"),
    (_serving(extra_args=["--tensor-parallel-size", "4"]), "serving.extra_args: --tensor-parallel-size"),
    (_serving(extra_args=["--tensor_parallel_size=4"]), "serving.extra_args: --tensor_parallel_size"),
    (_serving(extra_args=["-tp", "4"]), "serving.extra_args: -tp"),
    (_serving(extra_args=["--headless"]), "serving.extra_args: --headless"),
    (_serving(extra_args=["--served-model-name", "x"]), "serving.extra_args: --served-model-name"),
    # intervals and timeouts: a sane minimum
    (_supervisor(liveness_interval_s=1e-300), "supervisor.liveness_interval_s"),
    (_supervisor(liveness_interval_s=0.01, stall_s=1.0), "supervisor.liveness_interval_s"),
    (_supervisor(liveness_timeout_s=1e-9), "supervisor.liveness_timeout_s"),
    (_supervisor(head_lost_s=0.001), "supervisor.head_lost_s"),
    (_supervisor(stop_grace_s=1e-5), "supervisor.stop_grace_s"),
]


@pytest.mark.parametrize("mutate, needle", GAPS)
def test_validation_gaps_are_refused_naming_the_field(tmp_path, mutate, needle):
    data = good()
    mutate(data)
    refused(tmp_path, data, needle)


@pytest.mark.parametrize("mutate", [
    _node(1, gid_index="12"), _node(1, agent_host="spark-b.fabric.lan"), _node(1, agent_host="192.168.100.11"),
    _node(1, name="spark-b.example_2"), _node(1, name="spark-é"), _serving(extra_args=["--enforce-eager",
                                                                                        "--max-logprobs=5"]),
    _supervisor(liveness_interval_s=0.5, stall_s=2.0), _node(0, address="fd00::1"),
])
def test_near_misses_still_pass(tmp_path, mutate):
    data = good()
    mutate(data)
    path, r = config_check(tmp_path, data)
    assert r.exit_code == 0, r.output


# ------------------------------------------------------------------- item 5: a closed API
def test_the_api_binds_the_fabric_address_unless_told_otherwise(tmp_path):
    """The template writes no wildcard bind for the head; a file without api_host binds the
    head's fabric address (and `render` says so)."""
    head = tomllib.loads(template())["nodes"][0]
    assert head.get("api_host") not in WILDCARDS, head
    data = good()
    assert "api_host" not in data["nodes"][0]
    path, r = config_check(tmp_path, data)
    assert r.exit_code == 0, r.output
    r = invoke("render", "--config", str(path), "--node", "spark-a")
    assert r.exit_code == 0, r.output
    assert "--host 192.168.100.10" in r.output, r.output


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _local_head(tmp_path: Path, api_host: str | None) -> Path:
    node = {"name": "h", "rank": 0, "address": "127.0.0.1", "api_port": free_port(), "agent_port": free_port(),
            "master_port": free_port()}
    if api_host is not None:
        node["api_host"] = api_host
    data = {"model": {"path": str(tmp_path / "no-model"), "served_name": "m"},
            "serving": {"tensor_parallel_size": 1, "vllm_command": ["/nonexistent/vllm"]}, "nodes": [node]}
    path = tmp_path / "cluster.toml"
    path.write_text(dumps(data))
    return path


NO_KEY = {"DSPARK_API_KEY": None, "VLLM_API_KEY": None, "DSPARK_API_KEY_FILE": None, "CREDENTIALS_DIRECTORY": None}


@pytest.mark.parametrize("api_host, key, open_", [
    ("0.0.0.0", None, True), ("::", None, True), ("0.0.0.0", "sk-open", False),
    ("127.0.0.1", None, False), (None, None, False),
])
def test_check_warns_on_an_open_api(tmp_path, api_host, key, open_):
    path = _local_head(tmp_path, api_host)
    env = dict(NO_KEY, DSPARK_API_KEY=key)
    r = invoke("check", "--config", str(path), "--node", "h", "--no-peers", env=env)
    assert r.exit_code in (0, 1) and "Traceback" not in r.output, r.output
    api_lines = [line for line in r.output.splitlines() if line.split()[1:2] == ["api.access"]]
    if open_:
        assert api_lines and api_lines[0].startswith("warn"), r.output
        assert "api_host" in r.output and "DSPARK_API_KEY" in r.output, r.output
    else:
        assert not api_lines or api_lines[0].startswith("ok"), r.output
    if key:
        assert key not in r.output


# ------------------------------------------------------------------- linear validation
def _many_nodes(n: int) -> dict:
    data = good()
    base = data["nodes"][1]
    data["nodes"] = [data["nodes"][0]] + [
        dict(base, name=f"n{i}", rank=i, address=f"10.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255}")
        for i in range(1, n)]
    data["serving"]["tensor_parallel_size"] = n
    return data


@contextlib.contextmanager
def _timed(out: list[float]):
    """This thread's CPU time without the garbage collector's passes (their cost grows with
    every object the test holds, not with what validation does). CPU time, not wall time: on a
    loaded host the wall time of one run also holds whatever ran while this thread waited for a
    core (a 15,000-node run measured 2.2 s wall against 0.1 s for 1,500 at a load of 10)."""
    gc.collect()
    gc.disable()
    t0 = time.thread_time()
    try:
        yield
    finally:
        out.append(time.thread_time() - t0)
        gc.enable()


def _validate_s(data: dict) -> float:
    took: list[float] = []
    with _timed(took), pytest.raises(ConfigError):  # ranks above 1023 are refused, one line per node
        C.from_dict(data)
    return took[0]


def _nodes_only(n: int) -> Cluster:
    return Cluster(model=ModelConfig(path="/m"), nodes=tuple(
        NodeConfig(name=f"n{i}", rank=i, address=f"10.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255}") for i in range(n)))


def _check_s(cluster: Cluster) -> float:
    took: list[float] = []
    with _timed(took):
        assert checks.check(cluster)  # ranks above 1023 and the parallel sizes are refused
    return took[0]


def test_validation_is_linear_in_the_node_count():
    """15,000 nodes against a 1,500-node baseline measured in the same run: the whole of
    validation, and the cross-node checks alone (duplicate names and ranks, ports per host),
    where the quadratic loop was. Measured here (garbage collector off while timed): whole
    0.033 s -> 0.35 s (11x; before the fix 0.24 s -> 9.9 s, 41x; 24 s in the issue);
    cross-node 0.012 s -> 0.14 s (before: 0.048 s -> 4.2 s)."""
    small, big = _many_nodes(1_500), _many_nodes(15_000)
    base = min(_validate_s(small) for _ in range(2))
    took = min(_validate_s(big) for _ in range(2))
    assert took < max(base, 0.05) * 30, (base, took)
    small, big = _nodes_only(1_500), _nodes_only(15_000)
    base = min(_check_s(small) for _ in range(2))
    took = min(_check_s(big) for _ in range(2))
    assert took < max(base, 0.05) * 20, (base, took)


def test_every_flag_render_writes_is_owned():
    """DSPARK_FLAGS (what extra_args may not set) holds every option render writes from the
    fields, on the head and on a worker, with every optional field set."""
    from dspark.node.launch import vllm_argv

    data = good()
    data["serving"].update(kv_cache_memory_bytes=8 * GIB, load_format="dummy", skip_tokenizer_init=True,
                           max_cudagraph_capture_size=72, extra_args=[])
    c = C.from_dict(data)
    for node in c.nodes:
        argv = vllm_argv(c, node)[len(c.serving.vllm_command):]
        argv = argv[:len(argv) - len(c.serving.extra_args)]
        flags = {a for a in argv if a.startswith("-")}
        assert flags and flags <= set(DSPARK_FLAGS), flags - set(DSPARK_FLAGS)
        assert all(command_line.owned_flag(f) == f for f in flags)
    c = C.from_dict(dict(good(), serving=dict(good()["serving"], speculative_config=None, extra_args=[])))
    assert {a for a in vllm_argv(c, c.head) if a.startswith("-")} <= set(DSPARK_FLAGS)
