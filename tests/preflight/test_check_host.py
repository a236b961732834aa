"""dspark check: GPU and driver (this machine's NVML, or its absence), memory against the plan,
swap and OOM killers, cache directories, and the model directory (real files: safetensors
headers, modes)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from dspark.preflight import host as H
from dspark.preflight import model_dir as M
from dspark.units import user as U
from tests.harness.plan_fixtures import write_header_only_shard

GiB = 1 << 30


def by_name(checks):
    return {c.name: c for c in checks}


# ------------------------------------------------------------------------------ GPU
def test_gpu_on_this_host_never_crashes():
    nvml = H.read_nvml()
    [c] = H.check_gpu(nvml, 1)
    if nvml["library"] is None:  # this machine: no NVIDIA driver
        assert c.status == "warn" and "libnvidia-ml.so.1 does not load" in c.seen and c.fix
    else:
        assert c.status in ("ok", "fail") and "driver" in c.seen


def test_nvml_library_that_does_not_exist():
    nvml = H.read_nvml(("/nonexistent/libnvidia-ml.so.1",))
    assert nvml["library"] is None and "/nonexistent" in nvml["tried"][0]
    assert H.check_gpu(nvml, 1)[0].status == "warn"


def test_gpu_verdicts_from_nvml_answers():
    driver_down = {"library": "libnvidia-ml.so.1", "driver": None, "cuda": None, "gpus": [],
                   "error": "Driver Not Loaded"}
    [c] = H.check_gpu(driver_down, 1)
    assert c.status == "fail" and "Driver Not Loaded" in c.seen
    one = {"library": "libnvidia-ml.so.1", "driver": "580.95.05", "cuda": "13.0",
           "gpus": [{"name": "NVIDIA GB10", "total": None, "free": None}]}
    [c] = H.check_gpu(one, 1)
    assert c.status == "ok" and "NVIDIA GB10" in c.seen and "driver 580.95.05" in c.seen
    assert H.check_gpu(one, 2)[0].status == "fail"


# ------------------------------------------------------------------------------ memory
def meminfo(tmp_path: Path, available_kib: int) -> Path:
    (tmp_path / "meminfo").write_text(f"MemTotal:       127000000 kB\nMemFree:        1000 kB\n"
                                      f"MemAvailable:   {available_kib} kB\n")
    return tmp_path


def test_unified_memory_against_the_plan(tmp_path):
    need = int(94.38 * GiB)
    proc = meminfo(tmp_path, 100 * 1024 * 1024)  # 100 GiB
    [c] = H.check_memory(need, "", {}, proc)
    assert c.status == "ok" and "100.00 GiB available" in c.seen and "94.38 GiB" in c.seen
    proc = meminfo(tmp_path, 60 * 1024 * 1024)
    [c] = H.check_memory(need, "", {}, proc)
    assert c.status == "fail" and "60.00 GiB" in c.seen and "gpu_memory_utilization" in c.fix


def test_discrete_gpu_memory_comes_from_nvml(tmp_path):
    proc = meminfo(tmp_path, 500 * 1024 * 1024)
    nvml = {"library": "x", "gpus": [{"name": "g", "total": 80 * GiB, "free": 10 * GiB}]}
    [c] = H.check_memory(20 * GiB, "", nvml, proc)
    assert c.status == "fail" and "NVML" in c.seen


def test_memory_not_compared_while_this_nodes_vllm_runs_or_without_a_plan(tmp_path):
    proc = meminfo(tmp_path, 1)
    assert H.check_memory(GiB, "", {}, proc, running="pid 42, serving")[0].status == "ok"
    c = H.check_memory(None, "no config.json", {}, proc)[0]
    assert c.status == "warn" and "no config.json" in c.seen


def test_this_hosts_meminfo():
    assert H.meminfo(Path("/proc"))["MemAvailable"] > 0


# ------------------------------------------------------------------------------ swap and OOM killers
def test_swap_and_oom_killers(tmp_path):
    (tmp_path / "swaps").write_text("Filename\t\t\t\tType\t\tSize\t\tUsed\t\tPriority\n"
                                    "/swap.img                               file\t\t8388604\t\t1048576\t\t-2\n")
    for pid, comm in (("812", "earlyoom"), ("90", "systemd-oomd"), ("1", "systemd")):
        (tmp_path / pid).mkdir()
        (tmp_path / pid / "comm").write_text(comm + "\n")
    got = H.check_swap_oom(tmp_path)
    swap = got[0]
    assert swap.status == "ok" and "8.0 GiB of swap (1.0 GiB used) on /swap.img" in swap.seen
    killers = [c for c in got if c.name == "memory.oom-killers"]
    assert [c.status for c in killers] == ["warn", "warn"]
    assert "earlyoom is running (pid 812)" in killers[0].seen and "--avoid" in killers[0].fix
    assert "systemd-oomd" in killers[1].seen and "oomctl" in killers[1].fix


def test_no_swap_no_killers(tmp_path):
    (tmp_path / "swaps").write_text("Filename\tType\tSize\tUsed\tPriority\n")
    got = H.check_swap_oom(tmp_path)
    assert [(c.status, c.seen) for c in got] == [("ok", "no swap"),
                                                 ("ok", "no earlyoom, systemd-oomd or nohang running")]


def test_this_hosts_swap_and_processes():
    got = H.check_swap_oom(Path("/proc"))
    assert got[0].name == "memory.swap" and all(c.status in ("ok", "warn") for c in got)


# ------------------------------------------------------------------------------ caches
def test_cache_directory_under_the_unit(tmp_path):
    base = tmp_path / "cache" / "dspark"
    (base / "triton").mkdir(parents=True)
    env = {"INVOCATION_ID": "x", "CACHE_DIRECTORY": str(base), "TRITON_CACHE_DIR": str(base / "triton")}
    got = by_name(H.check_caches(env, under_unit=True))
    assert got["cache.dirs"].status == "ok" and "1 of 7 JIT caches" in got["cache.dirs"].seen
    assert got["cache.room"].status in ("ok", "warn") and "GiB free" in got["cache.room"].seen


def test_cache_directory_missing_under_the_unit_fails(tmp_path):
    env = {"INVOCATION_ID": "x", "CACHE_DIRECTORY": str(tmp_path / "gone")}
    [c] = H.check_caches(env, under_unit=True)
    assert c.status == "fail"


def test_cache_directory_not_created_yet_on_demand(tmp_path):
    got = by_name(H.check_caches({"CACHE_DIRECTORY": str(tmp_path / "later" / "dspark")}, under_unit=False))
    assert got["cache.dirs"].status == "ok" and "not created yet" in got["cache.dirs"].seen
    assert str(tmp_path) in got["cache.room"].seen  # room measured on the nearest existing parent


# ------------------------------------------------------------------------------ model directory
TENSORS = {
    "model-00001-of-00002.safetensors": [("a.weight", "BF16", (64, 32)), ("b.weight", "F32", (16,))],
    "model-00002-of-00002.safetensors": [("c.weight", "BF16", (128, 32))],
}


def model(tmp_path: Path, total: int | None = None) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 2}))
    weight_map, size = {}, 0
    for shard, tensors in TENSORS.items():
        write_header_only_shard(d / shard, tensors)
        for name, _dtype, _shape in tensors:
            weight_map[name] = shard
    size = 64 * 32 * 2 + 16 * 4 + 128 * 32 * 2
    (d / M.INDEX).write_text(json.dumps({"metadata": {"total_size": size if total is None else total},
                                         "weight_map": weight_map}))
    (d / "tokenizer.json").write_text("{}")
    return d


ME = U.service_user("dspark-no-such-user", under_unit=False)


def test_whole_model_directory(tmp_path):
    d = model(tmp_path)
    checks, facts = M.check_model_dir(str(d), None, ME)
    got = by_name(checks)
    assert [c.status for c in checks] == ["ok", "ok", "ok"], checks
    assert "all 2 shards" in got["model.shards"].seen
    assert "every tensor of the index is in its shard" in got["model.size"].seen
    assert facts.weight_bytes == 64 * 32 * 2 + 16 * 4 + 128 * 32 * 2


def test_missing_shard_fails(tmp_path):
    d = model(tmp_path)
    (d / "model-00002-of-00002.safetensors").unlink()
    [c], _ = M.check_model_dir(str(d), None, ME)
    assert c.status == "fail" and "1 of the 2 shards" in c.seen and "model-00002-of-00002" in c.seen


def test_truncated_shard_fails(tmp_path):
    d = model(tmp_path)
    shard = d / "model-00002-of-00002.safetensors"
    os.truncate(shard, shard.stat().st_size - 100)
    c = by_name(M.check_model_dir(str(d), None, ME)[0])["model.size"]
    assert c.status == "fail" and "truncated" in c.seen


def test_tensor_of_the_index_missing_from_its_shard_fails(tmp_path):
    d = model(tmp_path)
    index = json.loads((d / M.INDEX).read_text())
    index["weight_map"]["d.weight"] = "model-00001-of-00002.safetensors"
    (d / M.INDEX).write_text(json.dumps(index))
    c = by_name(M.check_model_dir(str(d), None, ME)[0])["model.size"]
    assert c.status == "fail" and "d.weight" in c.seen


def test_total_size_disagreeing_with_the_headers_warns(tmp_path):
    d = model(tmp_path, total=12345)
    c = by_name(M.check_model_dir(str(d), None, ME)[0])["model.size"]
    assert c.status == "warn" and "12,345" in c.seen


def test_no_config_json_and_no_directory(tmp_path):
    [c], _ = M.check_model_dir(str(tmp_path / "nope"), None, ME)
    assert c.status == "fail" and "not a directory" in c.seen
    (tmp_path / "m").mkdir()
    [c], _ = M.check_model_dir(str(tmp_path / "m"), None, ME)
    assert c.status == "fail" and "no config.json" in c.seen


def test_config_only_is_fine_with_dummy_weights_only(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text('{"num_hidden_layers": 2}')
    assert by_name(M.check_model_dir(str(d), "dummy", ME)[0])["model.shards"].status == "ok"
    [c], _ = M.check_model_dir(str(d), None, ME)
    assert c.status == "fail" and "no *.safetensors" in c.seen


@pytest.fixture
def open_tmp():
    """A directory others may enter (pytest's own tmp root is mode 700: nobody else gets in)."""
    import shutil
    import tempfile

    d = Path(tempfile.mkdtemp(prefix="dspark-check-", dir="/tmp"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d)


def test_a_directory_above_that_others_cannot_enter(open_tmp):
    stranger = U.ServiceUser("stranger", 4242, frozenset({4242}), "test")
    top = open_tmp / "private"
    top.mkdir(mode=0o700)
    (top / "f").write_text("x")
    why = M.readable_by(top / "f", stranger)
    assert why is not None and str(top) in why and "enter" in why


def test_readable_by_follows_the_mode_bits(open_tmp):
    d = model(open_tmp)
    stranger = U.ServiceUser("stranger", 4242, frozenset({4242}), "test")
    os.chmod(d / "tokenizer.json", 0o600)  # owner only: the stranger cannot read it
    c = by_name(M.check_model_dir(str(d), None, stranger)[0])["model.readable"]
    assert c.status == "fail" and "tokenizer.json" in c.seen and "a+rX" in c.fix
    os.chmod(d / "tokenizer.json", 0o644)
    os.chmod(d, 0o700)  # the directory cannot be entered
    why = M.readable_by(d / "config.json", stranger)
    assert why is not None and "enter" in why
    os.chmod(d, 0o755)
    assert M.readable_by(d / "config.json", stranger) is None
    group = U.ServiceUser("grouped", 4243, frozenset({os.stat(d).st_gid}), "test")
    os.chmod(d / "config.json", 0o640)
    assert M.readable_by(d / "config.json", group) is None
    assert M.readable_by(d / "config.json", stranger) is not None


def test_service_user_falls_back_to_this_process():
    u = U.service_user("dspark-no-such-user", under_unit=False)
    assert u.uid == os.getuid() and "no 'dspark-no-such-user' user here" in u.why
    u = U.service_user("root", under_unit=False)
    assert u.uid == 0 and u.why == "the units' user"
