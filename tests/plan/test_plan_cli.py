"""`dspark plan` from the cluster file, on a header-only DeepSeek V4 Flash checkpoint."""

import json

import pytest

from tests.harness.dspark_cli import invoke_dspark
from tests.harness.pair import run_dspark
from tests.harness.plan_fixtures import write_dsv4_flash_checkpoint

GIB = 1024**3


@pytest.fixture(scope="module")
def dsv4_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("dsv4")
    write_dsv4_flash_checkpoint(path)
    return path


def cluster_file(tmp_path, model_dir, tp: int) -> str:
    nodes = [("a", "10.0.0.1"), ("b", "10.0.0.2")][:tp]
    text = f'[model]\npath = "{model_dir}"\n[serving]\ntensor_parallel_size = {tp}\n'
    for rank, (name, addr) in enumerate(nodes):
        text += f'[[nodes]]\nname = "{name}"\nrank = {rank}\naddress = "{addr}"\n'
    path = tmp_path / f"tp{tp}.toml"
    path.write_text(text)
    return str(path)


def test_seed_settings_fit_at_tp2(tmp_path, dsv4_dir):
    r = invoke_dspark("plan", "--config", cluster_file(tmp_path, dsv4_dir, 2), "--json")
    assert r.returncode == 0, r.stderr
    p = json.loads(r.stdout)
    assert p["fits"] is True
    assert round(p["weight_bytes"] / GIB, 2) == 155.42  # payload of the 155.43 GiB of shard files
    assert 77 < p["weight_bytes_per_rank"] / GIB < 80
    assert p["kv_bytes_per_token"] > 0 and p["kv_tokens"] > 0
    r = invoke_dspark("plan", "--config", cluster_file(tmp_path, dsv4_dir, 2))
    assert r.returncode == 0 and "GiB" in r.stdout


def test_tp1_does_not_fit_and_serve_refuses_before_starting_vllm(tmp_path, dsv4_dir):
    cfg = cluster_file(tmp_path, dsv4_dir, 1)
    r = invoke_dspark("plan", "--config", cfg, "--json")
    assert r.returncode == 1 and json.loads(r.stdout)["fits"] is False
    r = run_dspark("serve", "--config", cfg, "--node", "a")
    assert r.returncode == 2 and "does not fit" in r.stderr and "tensor_parallel_size" in r.stderr
    assert "Traceback" not in r.stderr


def test_missing_model_dir_is_a_clear_error(tmp_path):
    r = invoke_dspark("plan", "--config", cluster_file(tmp_path, tmp_path / "nope", 2))
    assert r.returncode == 2 and "plan:" in r.stderr and "Traceback" not in r.stderr
