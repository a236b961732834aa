"""This host: the GPU and its driver (NVML, the nvidia_uvm module), memory free against the
plan's need per rank, swap and OOM killers, and the cache directories the units persist."""

from __future__ import annotations

import ctypes
import os
import shutil
from collections.abc import Mapping
from pathlib import Path

from dspark.preflight.result import Check, fail, ok, warn

GiB = 1 << 30

# NVML is the driver's own library: loaded with ctypes, so the check needs no Python binding
# (the dspark package has none; vLLM's runtime has its own). NixOS links the driver's
# libraries under /run/opengl-driver/lib.
NVML_LIBRARIES = ("libnvidia-ml.so.1", "/run/opengl-driver/lib/libnvidia-ml.so.1")
NVML_SUCCESS, NVML_ERROR_NOT_SUPPORTED = 0, 3


class _Memory(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


def read_nvml(libraries: tuple[str, ...] = NVML_LIBRARIES) -> dict:
    """{"library": None} when no NVML library loads; else the driver version, CUDA version and
    each GPU's name and memory (None where NVML says "not supported"), or "error"."""
    lib, tried = None, []
    for name in libraries:
        try:
            lib = ctypes.CDLL(name)
            break
        except OSError as e:
            tried.append(f"{name}: {e}")
    if lib is None:
        return {"library": None, "tried": tried}
    lib.nvmlErrorString.restype = ctypes.c_char_p

    def err(code: int) -> str:
        try:
            return lib.nvmlErrorString(code).decode(errors="replace")
        except Exception:  # noqa: BLE001 (an old library without the symbol)
            return f"NVML error {code}"

    out: dict = {"library": name, "driver": None, "cuda": None, "gpus": []}
    init = getattr(lib, "nvmlInit_v2", None) or lib.nvmlInit
    rc = init()
    if rc != NVML_SUCCESS:
        out["error"] = err(rc)
        return out
    try:
        buf = ctypes.create_string_buffer(96)
        if lib.nvmlSystemGetDriverVersion(buf, 96) == NVML_SUCCESS:
            out["driver"] = buf.value.decode(errors="replace")
        cuda = ctypes.c_int()
        if lib.nvmlSystemGetCudaDriverVersion(ctypes.byref(cuda)) == NVML_SUCCESS:
            out["cuda"] = f"{cuda.value // 1000}.{cuda.value % 1000 // 10}"
        count = ctypes.c_uint()
        rc = (getattr(lib, "nvmlDeviceGetCount_v2", None) or lib.nvmlDeviceGetCount)(ctypes.byref(count))
        if rc != NVML_SUCCESS:
            out["error"] = err(rc)
            return out
        get = getattr(lib, "nvmlDeviceGetHandleByIndex_v2", None) or lib.nvmlDeviceGetHandleByIndex
        for i in range(min(count.value, 64)):
            handle = ctypes.c_void_p()
            if get(i, ctypes.byref(handle)) != NVML_SUCCESS:
                continue
            gpu: dict = {"name": None, "total": None, "free": None}
            if lib.nvmlDeviceGetName(handle, buf, 96) == NVML_SUCCESS:
                gpu["name"] = buf.value.decode(errors="replace")
            mem = _Memory()
            rc = lib.nvmlDeviceGetMemoryInfo(handle, ctypes.byref(mem))
            if rc == NVML_SUCCESS:
                gpu["total"], gpu["free"] = int(mem.total), int(mem.free)
            elif rc != NVML_ERROR_NOT_SUPPORTED:
                gpu["memory_error"] = err(rc)
            out["gpus"].append(gpu)
    finally:
        lib.nvmlShutdown()
    return out


def check_gpu(nvml: dict, gpus_per_node: int) -> list[Check]:
    if nvml.get("library") is None:
        return [warn("gpu", "no NVIDIA driver here: libnvidia-ml.so.1 does not load, so no GPU is visible (fine "
                     "for the CPU build of `dspark local`; vLLM on a GB10 node needs the driver)",
                     "install and load the NVIDIA driver (nvidia-smi must list the GPU)")]
    if "error" in nvml and not nvml["gpus"]:
        return [fail("gpu", f"NVML ({nvml['library']}) loads but answers: {nvml['error']}",
                     "load the NVIDIA driver (nvidia-smi must list the GPU); a reboot after a driver update")]
    names = ", ".join(g["name"] or "?" for g in nvml["gpus"]) or "none"
    seen = f"{len(nvml['gpus'])} GPU(s): {names}; driver {nvml['driver'] or '?'}, CUDA {nvml['cuda'] or '?'}"
    if len(nvml["gpus"]) < gpus_per_node:
        return [fail("gpu", seen + f"; the cluster file says {gpus_per_node} per node",
                     "check nvidia-smi, or set serving.gpus_per_node")]
    return [ok("gpu", seen)]


def kernel_module_loaded(name: str, sys: Path, proc: Path) -> bool:
    """A module is loaded: /sys/module/NAME (every loaded module, built in with parameters too)
    or its line in /proc/modules."""
    if (sys / "module" / name).is_dir():
        return True
    try:
        return any(line.split(" ", 1)[0] == name for line in (proc / "modules").read_text().splitlines())
    except OSError:
        return False


def check_uvm(nvml: dict, sys: Path, proc: Path, under_unit: bool) -> list[Check]:
    """gpu.uvm: CUDA needs nvidia_uvm (/dev/nvidia-uvm, the unified memory that GB10 serves
    from). The units allow its device but cannot load it: ProtectKernelModules= and
    NoNewPrivileges= (nvidia-modprobe is setuid) forbid that, so it must be loaded at boot."""
    driver = nvml.get("library") is not None or kernel_module_loaded("nvidia", sys, proc)
    if not driver:
        return [ok("gpu.uvm", "not checked: no NVIDIA driver here (see gpu)")]
    if kernel_module_loaded("nvidia_uvm", sys, proc):
        return [ok("gpu.uvm", "nvidia_uvm is loaded")]
    seen = (f"the NVIDIA driver is loaded but nvidia_uvm is not (neither {sys}/module/nvidia_uvm nor a line in "
            f"{proc}/modules): CUDA cannot initialise without it")
    fix = ("load it now and at boot: `modprobe nvidia_uvm` and `echo nvidia_uvm > /etc/modules-load.d/nvidia-uvm.conf` "
           "(NixOS: boot.kernelModules = [ \"nvidia_uvm\" ])")
    if under_unit:
        return [fail("gpu.uvm", seen + "; this unit cannot load it (ProtectKernelModules=, NoNewPrivileges=)", fix)]
    return [warn("gpu.uvm", seen + "; CUDA outside the units may load it through the setuid nvidia-modprobe, "
                 "the dspark units cannot (ProtectKernelModules=, NoNewPrivileges=) and fail their check", fix)]


# ------------------------------------------------------------------------------ memory
def meminfo(proc: Path) -> dict[str, int]:
    """/proc/meminfo in bytes."""
    out: dict[str, int] = {}
    try:
        text = (proc / "meminfo").read_text()
    except OSError:
        return out
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        f = rest.split()
        if f and f[0].isdigit():
            out[key] = int(f[0]) * (1024 if len(f) > 1 and f[1] == "kB" else 1)
    return out


def check_memory(need_bytes: int | None, why_no_plan: str, nvml: dict, proc: Path,
                 running: str | None = None) -> list[Check]:
    """Free memory against the plan's memory per rank (what vLLM takes: gpu_memory_utilization x
    usable memory, or weights + reserve + kv_cache_memory_bytes). vLLM refuses to start when
    less is free. A GPU whose NVML reports memory (a discrete GPU) is compared by NVML; GB10's
    unified memory is the host's, so MemAvailable in /proc/meminfo."""
    if running:
        return [ok("memory.free", f"not compared: this node's vLLM is running ({running}) and holds its memory; "
                   "checked before each start")]
    if need_bytes is None:
        return [warn("memory.free", f"no memory plan ({why_no_plan}): nothing to compare", "fix the model directory "
                     "(see model.*), then `dspark plan`")]
    gpus = [g for g in nvml.get("gpus", []) if g.get("free") is not None]
    if gpus:
        free, where = min(g["free"] for g in gpus), f"free on the GPU (NVML, the fullest of {len(gpus)})"
    else:
        free = meminfo(proc).get("MemAvailable")
        where = "available (unified memory: /proc/meminfo MemAvailable)"
        if free is None:
            return [warn("memory.free", "cannot read MemAvailable from /proc/meminfo", "run `free -g`")]
    seen = f"{free / GiB:.2f} GiB {where}; the plan needs {need_bytes / GiB:.2f} GiB per rank"
    if free < need_bytes:
        return [fail("memory.free", seen, "stop what holds the memory (another vLLM, a container: `nvidia-smi`, "
                     "`ps aux --sort=-rss | head`), drop the page cache (`sync; echo 1 > /proc/sys/vm/drop_caches`), "
                     "or lower serving.gpu_memory_utilization / kv_cache_memory_bytes")]
    return [ok("memory.free", seen)]


def proc_hides_others(proc: Path) -> bool:
    """`proc` is mounted with hidepid= (the units' ProtectProc=invisible): other users'
    processes are not listed in it."""
    try:
        lines = (proc / "self" / "mountinfo").read_text().splitlines()
    except OSError:
        return False
    for line in lines:
        head, _, tail = line.partition(" - ")
        fields, rest = head.split(), tail.split()
        if len(fields) > 4 and fields[4] == str(proc) and rest[:1] == ["proc"]:
            options = dict(o.partition("=")[::2] for o in (rest[2] if len(rest) > 2 else "").split(","))
            return options.get("hidepid", "0") not in ("0", "off")
    return False


def check_swap_oom(proc: Path) -> list[Check]:
    out: list[Check] = []
    try:
        rows = [line.split() for line in (proc / "swaps").read_text().splitlines()[1:] if line.strip()]
    except OSError:
        rows = None
    if rows is None:
        out.append(ok("memory.swap", "cannot read /proc/swaps"))
    elif not rows:
        out.append(ok("memory.swap", "no swap"))
    else:
        total = sum(int(r[2]) for r in rows if len(r) >= 4) * 1024
        used = sum(int(r[3]) for r in rows if len(r) >= 4) * 1024
        out.append(ok("memory.swap", f"{total / GiB:.1f} GiB of swap ({used / GiB:.1f} GiB used) on "
                      + ", ".join(r[0] for r in rows)))
    killers: dict[str, list[str]] = {}
    for pid_dir in proc.glob("[0-9]*"):
        comm = None
        try:
            comm = (pid_dir / "comm").read_text().strip()
        except OSError:
            continue
        if comm in ("earlyoom", "systemd-oomd", "nohang"):
            killers.setdefault(comm, []).append(pid_dir.name)
    if not killers and proc_hides_others(proc):
        out.append(ok("memory.oom-killers", f"not seen: {proc} hides other users' processes here (hidepid=, the "
                      "units' ProtectProc=invisible); `dspark check` outside the unit lists earlyoom, systemd-oomd "
                      "or nohang"))
    elif not killers:
        out.append(ok("memory.oom-killers", "no earlyoom, systemd-oomd or nohang running"))
    for comm, pids in sorted(killers.items()):
        fix = {
            "earlyoom": "`systemctl disable --now earlyoom`, or keep vLLM out of its reach: "
                        "EARLYOOM_ARGS=\"--avoid '(^|/)(python3?|vllm|dspark)$'\" in /etc/default/earlyoom",
            "systemd-oomd": "`oomctl` lists the cgroups it watches; keep system.slice out of them, or "
                            "`systemctl disable --now systemd-oomd`",
            "nohang": "`systemctl disable --now nohang`, or exclude vLLM in its configuration",
        }[comm]
        out.append(warn("memory.oom-killers", f"{comm} is running (pid {', '.join(sorted(pids))}): it can kill "
                        "the worker while vLLM loads or profiles, when memory runs short", fix))
    return out


# ------------------------------------------------------------------------------ caches
def check_caches(environ: Mapping[str, str], under_unit: bool) -> list[Check]:
    """The cache directory the units persist (CacheDirectory=dspark, where unit_names.CACHE_ENV points
    the JIT caches): exists (systemd creates it at the unit's start), writable by the service
    (under the unit), and room for the caches (below the CUDA cache's own cap, a warning)."""
    from dspark.units.names import CACHE_ENV

    base = Path((environ.get("CACHE_DIRECTORY") or "").split(":")[0] or "/var/cache/dspark")
    cap = next(int(v) for k, v in CACHE_ENV if k == "CUDA_CACHE_MAXSIZE")
    dirs = [Path(environ[k]) if under_unit and environ.get(k) else Path(v.replace("%C/dspark", str(base)))
            for k, v in CACHE_ENV if v.startswith("%C/dspark/")]
    probe = base
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        free = shutil.disk_usage(probe).free
    except OSError as e:
        return [warn("cache.dirs", f"cannot read free space under {probe}: {e.strerror}", "check the filesystem")]
    room = f"{free / GiB:.1f} GiB free on {probe if probe != base else base}"
    out: list[Check] = []
    if not base.exists():
        if under_unit:
            return [fail("cache.dirs", f"{base} does not exist, though systemd should have created it",
                         "check the unit's CacheDirectory= and the filesystem")]
        out.append(ok("cache.dirs", f"{base} not created yet (systemd creates CacheDirectory=dspark at the units' "
                      f"first start); {room}"))
    else:
        unwritable = [str(d) for d in [base, *dirs] if d.exists() and not os.access(d, os.W_OK)] if under_unit else []
        present = sum(1 for d in dirs if d.exists())
        if unwritable:
            out.append(fail("cache.dirs", f"not writable by this service: {', '.join(unwritable)}",
                            f"chown -R {os.getuid()} {base} (systemd does this for CacheDirectory= itself, "
                            "unless the directory was made by hand)"))
        else:
            out.append(ok("cache.dirs", f"{base} exists ({present} of {len(dirs)} JIT caches in it so far); {room}"))
    if free == 0:
        out.append(fail("cache.room", f"no space left: {room}", f"free space on {probe}'s filesystem"))
    elif free < cap:
        out.append(warn("cache.room", f"{room}, less than the CUDA JIT cache alone may take "
                        f"(CUDA_CACHE_MAXSIZE {cap / GiB:.0f} GiB in the units)",
                        f"free space on {probe}'s filesystem"))
    else:
        out.append(ok("cache.room", room))
    return out
