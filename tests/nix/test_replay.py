"""nix/replay_runtime: the runtime's build replayed on the real locked wheels, without nixpkgs.

Each failure the Nix build had is reproduced on the wheels involved with the build data it had
(runtime-build.json before the fix), and shown gone with the data as it is now. Those wheels
(tests/nix/replay_wheels.py's sets, about 2.7 GB) are fetched by .ci/setup into
$DSPARK_WHEEL_CACHE, else the replay's default cache directory. The full replay needs every
locked wheel (about 3.9 GB, `python3 -m nix.replay_runtime` fills the cache) and runs only where
they are cached. The small tests at the end run everywhere, on wheels they build.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.nix.nix_support import REPO
from tests.nix.replay_wheels import BUILD, BY_NAME, CACHE, SETS, TORCHCODEC, WHEELS, rr, wheels_of

pytestmark = pytest.mark.nix


def cached(*names: str) -> list:
    """The locked wheels of these packages (in the lock's order), skipping the test unless all
    are in the cache."""
    wheels = wheels_of(*names)
    missing = [w.name for w in wheels if not (CACHE / w.filename).is_file()]
    if missing:
        pytest.skip(f"locked wheels not cached in {CACHE} ({', '.join(missing)}); fetch them with "
                    f"`.venv/bin/python -m tests.nix.replay_wheels` (.ci/setup does) or set DSPARK_WHEEL_CACHE")
    return wheels


def installer() -> Path:
    path = CACHE / rr.plan.installer_wheel(BUILD).filename
    if not path.is_file():
        pytest.skip(f"installer {BUILD['installer']['version']} not cached in {CACHE}; fetch it with "
                    f"`.venv/bin/python -m tests.nix.replay_wheels` (.ci/setup does)")
    return path


def before_the_fix() -> dict:
    """runtime-build.json as the Nix build had it: no removals, stripped, same libraries."""
    old = copy.deepcopy(BUILD)
    old["remove_after_install"] = []
    old["strip"] = True
    return old


def clean_env() -> dict:
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}


def test_build_backend_clash_reproduced_and_fixed(tmp_path):
    wheels = cached(*SETS["build_backend.py clash"])
    clashes = rr.wheels.find_clashes(wheels, CACHE, before_the_fix())
    assert clashes == ["build_backend.py: installed by flashinfer-python and torch-c-dlpack-ext"]
    # installer itself refuses, as it did in the Nix build.
    errors = rr.wheels.install(tmp_path / "old", wheels, CACHE, before_the_fix(), installer(), log=lambda _: None)
    assert len(errors) == 1 and "build_backend.py" in errors[0] and "exists" in errors[0]
    assert rr.wheels.find_clashes(wheels, CACHE, BUILD) == []
    assert rr.wheels.install(tmp_path / "new", wheels, CACHE, BUILD, installer(), log=lambda _: None) == []


def test_nvshmem_plugins_needing_mpi_ucx_libfabric_reproduced_and_fixed(tmp_path):
    wheels = cached(*SETS["NVSHMEM"])
    old = tmp_path / "old"
    assert rr.wheels.install(old, wheels, CACHE, before_the_fix(), installer(), log=lambda _: None) == []
    missing = {line.rsplit(": ", 1)[1] for line in rr.checks.unresolved_needed(rr.elf.elf_objects(old), old, BUILD)}
    assert missing == {"libfabric.so.1", "libmpi.so.40", "liboshmem.so.40", "libpmix.so.2",
                       "libucp.so.0", "libucs.so.0"}
    new = tmp_path / "new"
    assert rr.wheels.install(new, wheels, CACHE, BUILD, installer(), log=lambda _: None) == []
    assert rr.checks.unresolved_needed(rr.elf.elf_objects(new), new, BUILD) == []
    # torch bootstraps NVSHMEM by unique id: that plugin and the IB transports stay.
    libdir = rr.wheels.site_packages(new) / "nvidia/nvshmem/lib"
    assert (libdir / "nvshmem_bootstrap_uid.so.3").is_file()
    assert (libdir / "nvshmem_transport_ibrc.so.3").is_file()


def test_torchcodec_needs_ffmpeg_and_is_left_out(tmp_path):
    assert "torchcodec" not in BY_NAME
    lock = json.loads((REPO / "nix/runtime-lock.json").read_text())
    assert "torchcodec" in lock["excluded"]
    if not (CACHE / TORCHCODEC.filename).is_file():
        pytest.skip(f"torchcodec {TORCHCODEC.version} not cached in {CACHE} to show why it is left out; fetch it "
                    f"with `.venv/bin/python -m tests.nix.replay_wheels` (.ci/setup does)")
    prefix = tmp_path / "tc"
    errors = rr.wheels.install(prefix, [TORCHCODEC], CACHE, BUILD, installer(), log=lambda _: None)
    assert errors == []
    unresolved = rr.checks.unresolved_needed(rr.elf.elf_objects(prefix), prefix, BUILD)
    missing = {line.rsplit(": ", 1)[1] for line in unresolved}
    assert "libavcodec.so.60" in missing and "libheif.so.1" in missing


def test_cutlass_dsl_pth_reproduced_with_pythonpath_and_fixed_by_the_venv(tmp_path):
    wheels = cached(*SETS["CUTLASS DSL"])
    prefix = tmp_path / "rt"
    assert rr.wheels.install(prefix, wheels, CACHE, BUILD, installer(), log=lambda _: None) == []
    site = rr.wheels.site_packages(prefix)
    # The old wrappers: the bare interpreter with PYTHONPATH, which never reads .pth files.
    old = rr.checks.pth_imports(site, Path(sys.executable).resolve(), dict(clean_env(), PYTHONPATH=str(site)))
    assert len(old) == 1 and old[0].startswith("nvidia_cutlass_dsl_packages.pth") and "`import cutlass`" in old[0]
    # The runtime's interpreter now: bin/python of a venv prefix.
    assert rr.checks.pth_imports(site, prefix / "bin" / "python", clean_env()) == []


def test_strip_misaligns_openblas_and_gfortran_reproduced_and_fixed(tmp_path):
    wheels = cached(*SETS["numpy"])
    if rr.checks.strip_tool() is None:
        pytest.skip("no aarch64 strip (apt-get install binutils-aarch64-linux-gnu)")
    prefix = tmp_path / "np"
    assert rr.wheels.install(prefix, wheels, CACHE, BUILD, installer(), log=lambda _: None) == []
    elves = rr.elf.elf_objects(prefix)
    broken = rr.checks.strip_breaks(elves, prefix, before_the_fix())
    names = sorted(Path(b.split(":")[0]).name.split("-")[0] for b in broken)
    assert names == ["libgfortran", "libscipy_openblas64_"], broken
    assert all("after strip -S" in b for b in broken)
    assert BUILD["strip"] is False
    assert rr.checks.strip_breaks(elves, prefix, BUILD) == []


def test_torch_and_the_cuda_libraries_it_loads_resolve_at_run_time(tmp_path):
    """torch with the CUDA libraries its requirements pull in (cuBLAS, cuDNN, cuSPARSELt, NCCL,
    NVSHMEM, ...): every DT_NEEDED resolves, and every library one of them loads by name at run
    time is found as the Nix build leaves it. Each entry of runtime-build.json that makes it so is
    shown needed: without it, the loads it answers are unresolved."""
    wheels = cached(*SETS["torch"])
    prefix = tmp_path / "torch"
    assert rr.wheels.install(prefix, wheels, CACHE, BUILD, installer(), log=lambda _: None) == []
    elves = rr.elf.elf_objects(prefix)
    assert rr.checks.unresolved_needed(elves, prefix, BUILD) == []

    def unresolved(build: dict) -> set[str]:
        # "lib/pythonX.Y/site-packages/nvidia/...: libfoo.so" -> "nvidia/...: libfoo.so"
        return {u.split("site-packages/", 1)[1] for u in rr.checks.check_runtime_loads(elves, prefix, build).unresolved}

    now = rr.checks.check_runtime_loads(elves, prefix, BUILD)
    assert now.unresolved == []
    resolved = {r.split("site-packages/", 1)[1] for r in now.resolved}
    site = rr.wheels.site_packages(prefix).relative_to(prefix)
    assert {f"nvidia/cudnn/lib/libcudnn.so.9: libcudnn_graph.so -> {site}/nvidia/cudnn/lib",
            "nvidia/nccl/lib/libnccl.so.2: libibverbs.so.1 / libibverbs.so -> nixpkgs rdma-core",
            "torch/lib/libtorch_cuda.so: libibverbs.so.1 -> nixpkgs rdma-core",
            "nvidia/nvshmem/lib/libnvshmem_host.so.3: libnccl.so.2 -> already loaded (preloaded)"} <= resolved
    assert now.driver and now.absent  # libcuda and friends from the host; the deliberately absent ones

    cudnn_subs = {f"nvidia/cudnn/lib/libcudnn.so.9: libcudnn_{n}.so" for n in ("adv", "cnn", "graph", "ops")} | {
        f"nvidia/cudnn/lib/libcudnn_graph.so.9: libcudnn_{n}.so"
        for n in ("engines_precompiled", "engines_runtime_compiled", "heuristic")}
    # cuDNN asks for its sub-libraries without the version and appends ".9" (dlopen_versioned).
    assert unresolved(dict(BUILD, dlopen_versioned=[])) == cudnn_subs
    # autoPatchelf drops the wheels' own $ORIGIN: libraries loading a sibling need it appended.
    assert unresolved(dict(BUILD, append_runpaths=[])) == cudnn_subs | {
        "nvidia/cu13/lib/libnvrtc.so.13: libnvrtc-builtins.so.13.0",
        "nvidia/cu13/lib/libcupti.so.13: libnvperf_host.so",
        "nvidia/cu13/lib/libcufile.so.0: libcufile_rdma.so.1"}
    # What `import torch` has loaded (libtorch_cuda's closure) answers a dlopen by soname.
    assert unresolved(dict(BUILD, preloaded=[])) == {
        "nvidia/cudnn/lib/libcudnn_engines_precompiled.so.9: libcublasLt.so.13",
        "nvidia/cudnn/lib/libcudnn_engines_precompiled.so.9: libnvrtc.so.13",
        "nvidia/cudnn/lib/libcudnn_adv.so.9: libcublasLt.so.13",
        "nvidia/cusparselt/lib/libcusparseLt.so.0: libnvrtc.so.13",
        "nvidia/nvshmem/lib/libnvshmem_host.so.3: libnccl.so.2"}
    # rdma-core on every RPATH: NCCL, NVSHMEM's IB transports and torch itself load libibverbs.
    no_rdma = copy.deepcopy(BUILD)
    for lib in no_rdma["host_libraries"]:
        lib.pop("append_runpath", None)
    assert unresolved(no_rdma) == {
        "nvidia/nccl/lib/libnccl.so.2: libibverbs.so.1 / libibverbs.so",
        "nvidia/nccl/lib/libnccl.so.2: libmlx5.so.1 / libmlx5.so",
        "nvidia/nvshmem/lib/nvshmem_transport_ibrc.so.3: libibverbs.so.1",
        "nvidia/nvshmem/lib/nvshmem_transport_ibrc.so.3: libmlx5.so.1 / libmlx5.so",
        "torch/lib/libtorch_cuda.so: libibverbs.so.1",
        "torch/lib/libtorch_cpu.so: libibverbs.so.1"}
    # Every deliberately absent library this set names is listed with its objects.
    assert len(unresolved(dict(BUILD, dlopen_absent=[]))) == len(now.absent)


def test_full_replay_of_the_lock_is_clean(tmp_path):
    """The whole lock replays with no problem (about 3.5 minutes, with every wheel cached)."""
    missing = [w.name for w in WHEELS if not (CACHE / w.filename).is_file()]
    if missing:
        pytest.skip(f"{len(missing)} of the {len(WHEELS)} locked wheels not cached in {CACHE} (first: {missing[0]}): "
                    f"the full replay runs where a developer fetched them all with `python3 -m nix.replay_runtime "
                    f"--cache {CACHE}` (about 3.9 GB), not in CI; or set DSPARK_WHEEL_CACHE")
    installer()
    proc = subprocess.run([sys.executable, "-m", "nix.replay_runtime", "--cache", str(CACHE),
                           "--offline", "--prefix", str(tmp_path / "runtime"), "--json", str(tmp_path / "r.json")],
                          cwd=REPO, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["ok"] is True and report["wheels"] == len(WHEELS)
    assert report["elf_objects"] > 400


# ---------------------------------------------------------------- everywhere: wheels built here

def make_wheel(path: Path, name: str, files: dict[str, str], pth: str | None = None) -> Path:
    whl = path / f"{name}-1.0-py3-none-any.whl"
    dist = f"{name}-1.0.dist-info"
    with zipfile.ZipFile(whl, "w") as z:
        for rel, text in files.items():
            z.writestr(rel, text)
        if pth is not None:
            z.writestr(f"{name}.pth", pth)
        z.writestr(f"{dist}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
        z.writestr(f"{dist}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{dist}/RECORD", "")
    return whl


def test_a_clash_is_reported_for_wheels_built_here(tmp_path):
    a = make_wheel(tmp_path, "alpha", {"shared.py": "A = 1\n", "alpha/__init__.py": ""})
    b = make_wheel(tmp_path, "beta", {"shared.py": "B = 1\n", "beta/__init__.py": ""})
    wheels = [rr.plan.Wheel("alpha", "1.0", a.name, ""), rr.plan.Wheel("beta", "1.0", b.name, "")]
    assert rr.wheels.find_clashes(wheels, tmp_path, {"remove_after_install": []}) == [
        "shared.py: installed by alpha and beta"]
    fixed = {"remove_after_install": [{"package": "alpha", "paths": ["shared.py"], "why": "test"}]}
    assert rr.wheels.find_clashes(wheels, tmp_path, fixed) == []


def test_unresolved_needed_names_the_object_and_the_library(tmp_path):
    # An aarch64 shared object needing one library the build provides and one it does not.
    prefix = tmp_path / "p"
    (prefix / "lib").mkdir(parents=True)
    obj = rr.elf.Elf(prefix / "lib" / "libx.so", rr.elf.EM_AARCH64, 3, needed=["libz.so.1", "libnope.so.9"])
    assert rr.checks.unresolved_needed([obj], prefix, BUILD) == ["lib/libx.so: libnope.so.9"]
    driver = rr.elf.Elf(prefix / "lib" / "liby.so", rr.elf.EM_AARCH64, 3, needed=["libcuda.so.1"])
    assert rr.checks.unresolved_needed([driver], prefix, BUILD) == []


def test_read_elf_on_a_real_object():
    elf = rr.elf.read_elf(Path(sys.executable).resolve())
    assert elf is not None and elf.type in (2, 3) and elf.loads
    libc = next(p for p in [Path("/lib/x86_64-linux-gnu/libc.so.6"), Path("/lib/aarch64-linux-gnu/libc.so.6")]
                if p.exists())
    assert rr.elf.read_elf(libc.resolve()).soname == "libc.so.6"
    assert rr.checks.misaligned(rr.elf.read_elf(libc.resolve())) is None


def test_bad_input_is_one_line_not_a_traceback(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "nix.replay_runtime", "--cache", str(tmp_path / "empty"),
                           "--offline"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.startswith("replay-runtime: ") and "not in" in proc.stderr and "Traceback" not in proc.stderr
