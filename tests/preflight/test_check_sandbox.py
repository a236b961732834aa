"""dspark check under the hardened units, on built /sys and /proc trees and on
this host (no NVIDIA driver): gpu.uvm, since the units allow /dev/nvidia-uvm but cannot load
nvidia_uvm (ProtectKernelModules=, NoNewPrivileges=); and memory.oom-killers, which cannot see
root's earlyoom through the units' /proc (ProtectProc=invisible) and says so."""

from __future__ import annotations

from pathlib import Path

from dspark.config import validate as C
from dspark.preflight import Host, run
from dspark.preflight import host as H

NVML = {"library": "libnvidia-ml.so.1", "driver": "580.95.05", "cuda": "13.0",
        "gpus": [{"name": "NVIDIA GB10", "total": None, "free": None}]}


def tree(tmp_path: Path, sys_modules: tuple[str, ...] = (), proc_modules: tuple[str, ...] = ()) -> tuple[Path, Path]:
    sys_root, proc = tmp_path / "sys", tmp_path / "proc"
    for name in sys_modules:
        (sys_root / "module" / name).mkdir(parents=True)
    proc.mkdir(parents=True)
    (proc / "modules").write_text("".join(f"{m} 1 0 - Live 0x0000000000000000\n" for m in proc_modules))
    return sys_root, proc


def test_driver_without_nvidia_uvm_fails_under_the_unit_and_warns_outside(tmp_path):
    sys_root, proc = tree(tmp_path, sys_modules=("nvidia", "nvidia_modeset"), proc_modules=("nvidia", "nvidia_modeset"))
    [c] = H.check_uvm(NVML, sys_root, proc, under_unit=True)
    assert c.status == "fail" and "nvidia_uvm is not" in c.seen and "modprobe nvidia_uvm" in c.fix
    [c] = H.check_uvm(NVML, sys_root, proc, under_unit=False)
    assert c.status == "warn" and "nvidia_uvm is not" in c.seen
    # The kernel module alone says the driver is there, NVML or not.
    [c] = H.check_uvm({"library": None}, sys_root, proc, under_unit=True)
    assert c.status == "fail"


def test_nvidia_uvm_loaded_by_either_source_is_ok(tmp_path):
    sys_root, proc = tree(tmp_path / "a", sys_modules=("nvidia", "nvidia_uvm"))
    assert H.check_uvm(NVML, sys_root, proc, under_unit=True)[0].status == "ok"
    # /sys/module hidden or missing: /proc/modules still names it (and a prefix is not a match).
    sys_root, proc = tree(tmp_path / "b", proc_modules=("nvidia", "nvidia_uvm"))
    assert H.check_uvm(NVML, sys_root, proc, under_unit=True)[0].status == "ok"
    sys_root, proc = tree(tmp_path / "c", proc_modules=("nvidia", "nvidia_uvm_tools"))
    assert H.check_uvm(NVML, sys_root, proc, under_unit=True)[0].status == "fail"


def test_no_driver_is_not_a_uvm_fault(tmp_path):
    sys_root, proc = tree(tmp_path)
    [c] = H.check_uvm({"library": None}, sys_root, proc, under_unit=True)
    assert c.status == "ok" and "no NVIDIA driver" in c.seen


def test_this_host(tmp_path):
    nvml = H.read_nvml()
    [c] = H.check_uvm(nvml, Path("/sys"), Path("/proc"), under_unit=False)
    loaded = Path("/sys/module/nvidia_uvm").is_dir()
    if nvml["library"] is None and not Path("/sys/module/nvidia").is_dir():  # this machine
        assert c.status == "ok" and "no NVIDIA driver" in c.seen
    else:
        assert c.status == ("ok" if loaded else "warn")


def test_gpu_uvm_is_a_line_of_dspark_check(tmp_path):
    sys_root, proc = tree(tmp_path, sys_modules=("nvidia",))
    (proc / "meminfo").write_text("MemTotal: 131072000 kB\nMemAvailable: 120000000 kB\n")
    (proc / "swaps").write_text("Filename\tType\tSize\tUsed\tPriority\n")
    cluster = C.from_dict({"model": {"path": str(tmp_path / "nomodel")}, "nodes": [
        {"name": "spark-a", "rank": 0, "address": "127.0.0.1"},
        {"name": "spark-b", "rank": 1, "address": "127.0.0.2"}]})
    host = Host(sys=sys_root, proc=proc, environ={"INVOCATION_ID": "x", "CACHE_DIRECTORY": str(tmp_path)},
                addresses=lambda: {"lo": ["127.0.0.1", "127.0.0.2"]}, nvml=lambda: dict(NVML), peers=False,
                identity={})
    report = run(cluster, cluster.nodes[1], host)
    uvm = [c for c in report.checks if c.name == "gpu.uvm"]
    assert len(uvm) == 1 and uvm[0].status == "fail", report.lines()
    assert "gpu.uvm" in "\n".join(report.lines())


def mountinfo(proc: Path, options: str) -> None:
    (proc / "self").mkdir(parents=True, exist_ok=True)
    (proc / "self" / "mountinfo").write_text(
        "1 0 0:1 / / rw - overlay overlay rw\n"
        f"22 1 0:21 / {proc} rw,nosuid,nodev,noexec,relatime - proc proc {options}\n")


def test_oom_killers_hidden_by_protect_proc_are_not_reported_as_absent(tmp_path):
    proc = tmp_path / "proc"
    (proc / "1").mkdir(parents=True)  # only this process's own entries would be listed
    (proc / "swaps").write_text("Filename\tType\tSize\tUsed\tPriority\n")
    mountinfo(proc, "rw,hidepid=invisible")
    oom = {c.name: c for c in H.check_swap_oom(proc)}["memory.oom-killers"]
    assert "not seen" in oom.seen and "ProtectProc=invisible" in oom.seen
    mountinfo(proc, "rw")
    oom = {c.name: c for c in H.check_swap_oom(proc)}["memory.oom-killers"]
    assert oom.seen.startswith("no earlyoom")
