"""The cluster file: good files load, bad ones are refused with messages naming the field."""

import tomllib
from pathlib import Path

import pytest

from dspark.config import validate as C
from dspark.config.schema import ConfigError, ServingConfig
from dspark.config.template import template
from tests.harness.dspark_cli import invoke_dspark

FIXTURE = Path(__file__).parents[1] / "fixtures" / "cluster-two-node.toml"


def good() -> dict:
    return tomllib.loads(FIXTURE.read_text())


def problems(data: dict) -> list[str]:
    with pytest.raises(ConfigError) as e:
        C.from_dict(data, "test.toml")
    return e.value.problems


def test_fixture_loads_with_seed_defaults():
    c = C.from_dict(good())
    assert [n.name for n in c.nodes] == ["spark-a", "spark-b"]
    assert c.head.name == "spark-a" and [w.name for w in c.workers] == ["spark-b"]
    s = c.serving
    # The seed's tested serving settings are the defaults.
    assert (s.tensor_parallel_size, s.max_model_len, s.max_num_seqs, s.max_num_batched_tokens) == (2, 350000, 12, 8192)
    assert (s.gpu_memory_utilization, s.kv_cache_dtype, s.block_size) == (0.835, "nvfp4_ds_mla", 256)
    assert s.speculative_config["num_speculative_tokens"] == 5
    assert s.cudagraph_capture_size == 72  # 12 x (5 + 1)
    assert c.node("spark-b").agent_url == "http://192.168.100.11:8890"
    assert c.head.api_url == "http://192.168.100.10:8888"


def test_every_default_is_overridable():
    data = good()
    data["serving"].update(max_model_len=65536, max_num_seqs=4, speculative_config={}, kv_cache_dtype="fp8_ds_mla")
    c = C.from_dict(data)
    assert (c.serving.max_model_len, c.serving.max_num_seqs, c.serving.kv_cache_dtype) == (65536, 4, "fp8_ds_mla")
    assert c.serving.cudagraph_capture_size == 4


def test_tp4_ring_needs_no_code_change():
    data = good()
    data["serving"]["tensor_parallel_size"] = 4
    data["nodes"] += [
        {"name": "spark-c", "rank": 2, "address": "192.168.100.12"},
        {"name": "spark-d", "rank": 3, "address": "192.168.100.13"},
    ]
    c = C.from_dict(data)
    assert [w.rank for w in c.workers] == [1, 2, 3]


def test_placeholders_refused_naming_each_field():
    data = good()
    data["nodes"][1]["address"] = "CHANGEME"
    data["model"]["path"] = "/models/CHANGEME"
    p = problems(data)
    assert any(x.startswith("nodes[1].address: still the placeholder CHANGEME") for x in p)
    assert any(x.startswith("model.path: still the placeholder") and "Write e.g." in x for x in p)


def test_template_is_refused_until_filled_in_and_then_accepted(tmp_path):
    text = template()
    assert text.count("# ") > 20  # every field carries its help text
    p = problems(tomllib.loads(text))
    assert len(p) == 9 and all("CHANGEME" in x for x in p)
    filled = (text.replace('"/var/lib/dspark/models/CHANGEME"', '"/models/dsv4"')
              .replace('"CHANGEME-head-hostname"', '"a"').replace('"CHANGEME-worker-hostname"', '"b"'))
    filled = filled.replace('address = "CHANGEME"', 'address = "10.0.0.1"', 1).replace(
        'address = "CHANGEME"', 'address = "10.0.0.2"', 1).replace('"CHANGEME"', '"eth1"')
    c = C.from_dict(tomllib.loads(filled))
    assert c.serving == ServingConfig()  # the template writes exactly the defaults


@pytest.mark.parametrize("mutate, expected", [
    (lambda d: d["nodes"][1].update(rank=0), "rank 0 is given to more than one node"),
    (lambda d: d["nodes"][0].update(role="head", rank=1) or d["nodes"][1].update(rank=0, role=None),
     "the head must be rank 0"),
    (lambda d: d["serving"].update(tensor_parallel_size=4), "must equal nodes (2) x gpus_per_node (1) = 2"),
    (lambda d: d["nodes"][0].update(agent_port=8888), "port 8888 is used twice on host 192.168.100.10"),
    (lambda d: d["nodes"][1].update(address="192.168.100.10", agent_port=25000), "port 25000 is used twice"),
    (lambda d: d["nodes"][1].update(name="spark-a"), "'spark-a' is used by more than one node"),
    (lambda d: d["serving"].update(gpu_memory_utilization=1.5), "must be in (0, 1]"),
    (lambda d: d["serving"].update(max_num_seqs="twelve"), "serving.max_num_seqs: expected an integer, got \"twelve\""),
    (lambda d: d["serving"].update(max_num_seq=4), "serving.max_num_seq: unknown key; did you mean 'max_num_seqs'?"),
    (lambda d: d["nodes"][0].update(address="spark-a.local"), "is not an IP address"),
    (lambda d: d["serving"].update(env={"VLLM_API_KEY": "x"}), "a secret does not belong in the cluster file"),
    (lambda d: d.update(servng={}), "servng: unknown section; did you mean [serving]?"),
    (lambda d: d.pop("nodes"), "nodes: missing"),
    (lambda d: d["nodes"][1].pop("address"), "nodes[1].address: missing"),
    (lambda d: d["nodes"][0].update(gid_index="three"), "must be a number or \"auto\""),
])
def test_contradictions_and_type_errors_refused(mutate, expected):
    data = good()
    mutate(data)
    assert any(expected in x for x in problems(data)), problems(data)


def test_node_by_name_and_unknown_name():
    c = C.from_dict(good())
    assert c.node("spark-b").rank == 1
    with pytest.raises(ConfigError, match="no node named 'nope'.*spark-a, spark-b"):
        c.node("nope")


def test_cli_check_and_init(tmp_path):
    path = tmp_path / "cluster.toml"
    r = invoke_dspark("config", "init", str(path))
    assert r.returncode == 0 and path.exists()
    r = invoke_dspark("config", "init", str(path))
    assert r.returncode == 2 and "exists" in r.stderr
    r = invoke_dspark("config", "check", "--config", str(path))
    assert r.returncode == 2 and "CHANGEME" in r.stderr and "Traceback" not in r.stderr
    r = invoke_dspark("config", "check", "--config", str(FIXTURE))
    assert r.returncode == 0 and "OK: 2 nodes" in r.stdout


@pytest.mark.parametrize("text, expected", [
    ("[model\npath = 1", "not valid TOML"),
    ("", "model: missing"),
])
def test_cli_bad_files_give_messages_not_tracebacks(tmp_path, text, expected):
    path = tmp_path / "c.toml"
    path.write_text(text)
    r = invoke_dspark("config", "check", "--config", str(path))
    assert r.returncode == 2 and expected in r.stderr and "Traceback" not in r.stderr
    r = invoke_dspark("config", "check", "--config", str(tmp_path / "missing.toml"))
    assert r.returncode == 2 and "file not found" in r.stderr


@pytest.mark.parametrize("value, needle", [
    (float("inf"), "positive, finite"), (float("nan"), "positive, finite"), (0.0, "positive, finite"),
    (6.0, "at least twice liveness_interval_s"),
])
def test_stall_s_is_finite_and_spans_two_liveness_readings(value, needle):
    data = good()
    data.setdefault("supervisor", {}).update(stall_s=value, liveness_interval_s=5.0)
    assert any(p.startswith("supervisor.stall_s") and needle in p for p in problems(data)), problems(data)


def test_stall_s_default_and_override():
    assert C.from_dict(good()).supervisor.stall_s == 180.0
    data = good()
    data.setdefault("supervisor", {})["stall_s"] = 600
    assert C.from_dict(data).supervisor.stall_s == 600.0
