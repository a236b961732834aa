"""The cluster file as a careless or hostile user writes it:
every bad file is refused by `dspark config check` (and by serve, with exit 2) with a message
naming the field, never a traceback, never a hang."""

from __future__ import annotations

import dataclasses
import math
import os
import shlex
import subprocess
import tomllib
from pathlib import Path

import pytest

from dspark.config import validate as C
from dspark.config.schema import ConfigError, NodeConfig, ServingConfig, SupervisorConfig
from dspark.config.template import dumps
from dspark.node.launch import render
from tests.harness.dspark_cli import invoke_dspark
from tests.harness.pair import run_dspark

FIXTURE = Path(__file__).parents[1] / "fixtures" / "cluster-two-node.toml"


def good() -> dict:
    return tomllib.loads(FIXTURE.read_text())


def write(tmp_path: Path, data: dict) -> Path:
    path = tmp_path / "cluster.toml"
    path.write_text(dumps(data))
    return path


def refused(path: Path, needle: str, timeout: float | None = None) -> str:
    """`config check` refuses `path` with `needle` in its message. With `timeout` (a file that
    could block its reader), in a process of its own that is killed past it; else in-process."""
    args = ("config", "check", "--config", str(path))
    r = run_dspark(*args, timeout=timeout) if timeout is not None else invoke_dspark(*args)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert needle in r.stderr, r.stderr
    return r.stderr


# ------------------------------------------------------------------- item 1: finite ranges
FLOAT_FIELDS = [(section, f.name) for section, cls in (("serving", ServingConfig), ("supervisor", SupervisorConfig))
                for f in dataclasses.fields(cls) if "float" in str(f.type)]


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan, -1.0, 0.0, 1e300])
@pytest.mark.parametrize("section, name", FLOAT_FIELDS)
def test_every_float_field_is_finite_and_in_range(section, name, value):
    data = good()
    data.setdefault(section, {})[name] = value
    cls = ServingConfig if section == "serving" else SupervisorConfig
    meta = next(f for f in dataclasses.fields(cls) if f.name == name).metadata
    # a field whose declared range starts at 0 (drain_s: 0 aborts at once)
    if value == 0.0 and meta["bounds"][0] == 0 and not meta["positive"]:
        assert getattr(getattr(C.from_dict(data, "t.toml"), section), name) == 0.0
        return
    with pytest.raises(ConfigError) as e:
        C.from_dict(data, "t.toml")
    assert any(p.startswith(f"{section}.{name}: must be") for p in e.value.problems), e.value.problems


def test_ranges_cover_every_number_field():
    for cls in (ServingConfig, SupervisorConfig, NodeConfig):
        for f in dataclasses.fields(cls):
            if ("int" in str(f.type) or "float" in str(f.type)) and not f.name.endswith("_port"):
                assert f.metadata.get("bounds"), f"{cls.__name__}.{f.name} has no declared range"


@pytest.mark.parametrize("text", ["stop_grace_s = inf", "ready_timeout_s = nan", "head_lost_s = 1e400"])
def test_cli_refuses_infinite_supervisor_times(tmp_path, text):
    path = write(tmp_path, good())
    path.write_text(path.read_text().replace("[supervisor]", "[supervisor]\n" + text) if "[supervisor]" in
                    path.read_text() else path.read_text() + "\n[supervisor]\n" + text + "\n")
    refused(path, "positive, finite number of seconds")


@pytest.mark.parametrize("value", ["inf", "nan"])
def test_plan_refuses_infinite_memory_with_a_message(tmp_path, value):
    path = write(tmp_path, good())
    path.write_text(path.read_text().replace("[serving]", f"[serving]\nusable_memory_gib = {value}", 1))
    r = invoke_dspark("plan", "--config", str(path))
    assert r.returncode == 2 and "Traceback" not in r.stderr and "usable_memory_gib" in r.stderr, r.stderr


def test_huge_integers_are_refused_not_crashed(tmp_path):
    data = good()
    data["serving"]["max_num_seqs"] = 2**62
    refused(write(tmp_path, data), "serving.max_num_seqs: must be a whole number")
    data = good()
    data.setdefault("supervisor", {})["stall_s"] = 10**400
    refused(write(tmp_path, data), "supervisor.stall_s: a 401-digit number is out of range")


# ------------------------------------------------------------------- item 2: env keys, NUL
@pytest.mark.parametrize("env", [{"A=B": "1"}, {"A\0B": "1"}, {"A": "x\0y"}, {"": "1"}, {"1A": "1"},
                                 {"A;touch /tmp/pwned;B": "1"}, {"$(id)": "1"}])
def test_bad_env_names_and_nul_refused_by_check_and_by_serve(tmp_path, env):
    data = good()
    data["serving"]["env"] = env
    path = write(tmp_path, data)
    refused(path, "serving.env")
    r = run_dspark("serve", "--config", str(path), "--node", "spark-b", "--skip-plan", timeout=30)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr


@pytest.mark.parametrize("field, value", [("served_name", "a\0b"), ("vllm_command", ["vllm\0"]),
                                          ("extra_args", ["--x", "\0"])])
def test_nul_anywhere_is_refused(tmp_path, field, value):
    data = good()
    data["model" if field == "served_name" else "serving"][field] = value
    refused(write(tmp_path, data), "NUL")


# ------------------------------------------------------------------- item 6: secrets
# vllm_command is the argv's prefix: a secret there shows in ps and the journal like one in extra_args.
@pytest.mark.parametrize("field, args", [("extra_args", ["--api-key", "sk-1"]), ("extra_args", ["--api-key=sk-1"]),
                                         ("extra_args", ["--hf-token", "hf_x"]),
                                         ("extra_args", ["--enforce-eager", "--api-key=sk-1"]),
                                         ("vllm_command", ["vllm", "--api-key", "sk-1"]),
                                         ("vllm_command", ["python3", "-m", "vllm", "--api-key=sk-1"]),
                                         ("vllm_command", ["vllm", "--hf-token=hf_x"])])
def test_secret_on_the_command_line_is_refused(tmp_path, field, args):
    data = good()
    data["serving"][field] = args
    err = refused(write(tmp_path, data), f"serving.{field}")
    assert "sk-1" not in err and "hf_x" not in err


@pytest.mark.parametrize("key", ["HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "OPENAI_API_KEY", "AWS_SECRET_ACCESS_KEY",
                                 "VLLM_API_KEY", "MY_SERVICE_PASSWORD", "GITHUB_TOKEN"])
def test_secret_env_refused_in_shared_and_node_env(tmp_path, key):
    data = good()
    data["serving"]["env"] = {key: "hush"}
    refused(write(tmp_path, data), f"serving.env.{key}: a secret does not belong")
    data = good()
    data["nodes"][1]["env"] = {key: "hush"}
    refused(write(tmp_path, data), f".env.{key}: a secret does not belong")


def test_the_policy_leaves_ordinary_names_alone():
    from dspark.config.secret_policy import is_secret_env, is_secret_flag

    for name in ("TOKENIZERS_PARALLELISM", "NCCL_IB_HCA", "PYTORCH_CUDA_ALLOC_CONF", "VLLM_KEY_CACHE", "KEYS"):
        assert not is_secret_env(name), name
    for flag in ("--max-num-batched-tokens", "--tokenizer", "--tokenizer-mode", "--skip-tokenizer-init",
                 "--ssl-keyfile", "--allowed-token-ids", "--num-speculative-tokens"):
        assert not is_secret_flag(flag), flag
    C.from_dict(good())  # the seed's settings pass


def test_redaction_covers_the_equals_form():
    from dspark.config.secret_policy import REDACTED, redact_args

    assert redact_args(["--api-key=sk-1", "--hf-token", "hf_x", "--max-num-batched-tokens", "8192"]) == \
        [f"--api-key={REDACTED}", "--hf-token", REDACTED, "--max-num-batched-tokens", "8192"]


def test_bench_report_settings_never_hold_a_secret():
    from dspark.cli.bench import cluster_settings

    c = C.from_dict(good())
    c = dataclasses.replace(c, serving=dataclasses.replace(c.serving, extra_args=["--api-key=sk-1", "--x"]))
    assert "sk-1" not in str(cluster_settings(c))


# ------------------------------------------------------------------- item 7: the file itself
def test_non_utf8_file(tmp_path):
    path = tmp_path / "c.toml"
    path.write_bytes(b'[model]\npath = "/m\xff\xfe"\n')
    refused(path, "not UTF-8")


@pytest.mark.parametrize("text", ["a = " + "[" * 5000 + "]" * 5000, "a = " + "{b = " * 3000 + "1" + "}" * 3000,
                                  "[serving]\nspeculative_config = " + "{a = " * 12 + "1" + "}" * 12])
def test_deeply_nested_file(tmp_path, text):
    path = tmp_path / "c.toml"
    path.write_text('[model]\npath = "/m"\n' + text + "\n")
    refused(path, "nested")


def test_dev_zero_and_directories(tmp_path):
    refused(Path("/dev/zero"), "not a regular file")
    with pytest.raises(ConfigError, match="not a regular file"):
        C.load(tmp_path)  # the CLI's --config already refuses a directory


def test_huge_file(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("# " + "x" * (C.MAX_FILE_BYTES + 10) + "\n")
    refused(path, "larger than")


def test_fifo_does_not_hang(tmp_path):
    fifo = tmp_path / "c.toml"
    os.mkfifo(fifo)
    refused(fifo, "not a regular file", timeout=20)


def test_datetime_in_speculative_config(tmp_path):
    path = write(tmp_path, good())
    path.write_text(path.read_text().replace(
        "[serving]", "[serving]\nspeculative_config = { method = \"x\", when = 1979-05-27T07:32:00Z }", 1))
    refused(path, "speculative_config.when")
    r = invoke_dspark("render", "--config", str(path), "--node", "spark-a")
    assert r.returncode == 2 and "Traceback" not in r.stderr


def test_ipv6_address_with_gid_index_auto(tmp_path):
    data = good()
    for n in data["nodes"]:
        n.update(address=f"fd00::{n['rank'] + 1}", rdma_device="rocep1s0f0", gid_index="auto")
    refused(write(tmp_path, data), "gid_index: \"auto\" finds the RoCEv2 GID of an IPv4 address")
    for n in data["nodes"]:
        n["gid_index"] = "3"
    C.load(write(tmp_path, data))


# ------------------------------------------------------------------- item 12: writers
@pytest.mark.parametrize("value", ["line\nbreak", "nul\0byte", "tab\tand\r\x1b[31m\x7f", "quote\"back\\slash",
                                   "unicode é ✓", "'single'"])
def test_toml_writer_round_trips_every_string(value):
    data = {"model": {"path": value, "served_name": "m"}, "serving": {"env": {"K": value, "odd key.x": value}}}
    assert tomllib.loads(dumps(data)) == data


def test_render_output_never_runs_anything_but_vllm(tmp_path):
    """Pasting `dspark render` into a shell: env names that are not shell names would be commands;
    the config refuses them, and render itself quotes them (through env(1)) if one gets there."""
    c = C.from_dict(good())
    launch = render(c, c.head)
    launch.env["A;touch " + str(tmp_path / "pwned") + ";B"] = "1"
    text = launch.shell().replace(shlex.quote(launch.argv[0]), "true", 1)
    subprocess.run(["bash", "-c", text], cwd=tmp_path, timeout=10, capture_output=True)
    assert not (tmp_path / "pwned").exists()
