"""nix/driver-libs.sh, sourced by the runtime's bin/vllm wrapper: find the NVIDIA driver's
libraries on NixOS (/run/opengl-driver/lib) or DGX OS (Ubuntu's driver directory), or say which
file it looked for where, before vLLM starts.

There is no NVIDIA driver here; the driver directories are made by the tests, and the library
that vLLM loads by bare name is a real shared object (this machine's libz) under the driver's
name, loaded with ctypes the way vLLM's NVML binding does."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.nix.nix_support import REPO

pytestmark = pytest.mark.nix

BUILD = json.loads((REPO / "nix/runtime-build.json").read_text())
SCRIPT = REPO / "nix/driver-libs.sh"
LIBZ = next(p for p in [Path("/lib/x86_64-linux-gnu/libz.so.1"), Path("/lib/aarch64-linux-gnu/libz.so.1"),
                        Path("/usr/lib/x86_64-linux-gnu/libz.so.1")] if p.exists())


def driver_dir(path: Path, *extra: str) -> Path:
    path.mkdir(parents=True)
    for name in [*BUILD["driver_libraries"], *extra]:
        shutil.copyfile(LIBZ, path / name)
    return path


def run_wrapper(tmp_path: Path, dirs: list[Path], then: str, env: dict | None = None):
    """What the wrapper does: source the script with runtime.nix's arguments, then run `then`."""
    args = " ".join(f"'{a}'" for a in [SCRIPT, " ".join(BUILD["driver_libraries"]), " ".join(map(str, dirs)),
                                         " ".join(BUILD["driver_library_globs"])])
    base = {"PATH": os.environ["PATH"], "HOME": str(tmp_path / "home"), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    return subprocess.run(["bash", "-c", f"set -eu; source {args}; {then}"], env=dict(base, **(env or {})),
                          capture_output=True, text=True, timeout=60)


def test_search_dirs_are_nixos_then_dgx_os():
    dirs = BUILD["driver_search_dirs"]
    assert dirs[0] == "/run/opengl-driver/lib"          # NixOS, hardware.nvidia
    assert "/usr/lib/aarch64-linux-gnu" in dirs          # DGX OS (Ubuntu's driver packages)
    assert BUILD["driver_libraries"] == ["libcuda.so.1", "libnvidia-ml.so.1"]


def test_missing_driver_says_what_was_looked_for_where_and_stops(tmp_path):
    nixos, ubuntu = tmp_path / "run-opengl", tmp_path / "usr-lib"
    ubuntu.mkdir()
    shutil.copyfile(LIBZ, ubuntu / "libcuda.so.1")  # half a driver is no driver
    proc = run_wrapper(tmp_path, [nixos, ubuntu], "echo vllm-started")
    assert proc.returncode == 1
    assert "vllm-started" not in proc.stdout
    for lib in BUILD["driver_libraries"]:
        assert f"looked for {lib} in: {nixos} {ubuntu}" in proc.stderr
    assert "DSPARK_DRIVER_LIB_DIR" in proc.stderr and "Traceback" not in proc.stderr


def test_found_driver_is_loadable_by_bare_name(tmp_path):
    ubuntu = driver_dir(tmp_path / "usr-lib", "libnvidia-ptxjitcompiler.so.1")
    (ubuntu / "libstdc++.so.6").write_text("the host's own libraries must stay out of the path")
    code = "import ctypes; ctypes.CDLL('libnvidia-ml.so.1'); ctypes.CDLL('libcuda.so.1'); print('loaded')"
    # Before: the wrappers only set TRITON_LIBCUDA_PATH, and the bare name is not found.
    before = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert before.returncode != 0 and "libnvidia-ml.so.1" in before.stderr
    proc = run_wrapper(tmp_path, [tmp_path / "no-nixos", ubuntu],
                       f"{sys.executable} -c \"{code}\"; echo \"$LD_LIBRARY_PATH\"; echo \"$TRITON_LIBCUDA_PATH\"")
    assert proc.returncode == 0, proc.stderr
    loaded, ld_path, triton = proc.stdout.split()
    assert loaded == "loaded"
    linkdir = Path(ld_path.split(":")[0])
    assert triton == str(linkdir) and linkdir.is_relative_to(tmp_path / "cache")
    names = sorted(p.name for p in linkdir.iterdir())
    # The driver's own files (and libcuda.so for Triton's -lcuda), not the host's libstdc++.
    assert names == ["libcuda.so", "libcuda.so.1", "libnvidia-ml.so.1", "libnvidia-ptxjitcompiler.so.1"]
    assert all((linkdir / n).resolve().parent == ubuntu.resolve() for n in names)


def test_nixos_dir_wins_and_override_and_unit_settings_are_kept(tmp_path):
    nixos = driver_dir(tmp_path / "run-opengl")
    ubuntu = driver_dir(tmp_path / "usr-lib")
    out = run_wrapper(tmp_path, [nixos, ubuntu], "readlink \"${LD_LIBRARY_PATH%%:*}/libcuda.so.1\"",
                      env={"LD_LIBRARY_PATH": "/opt/keep"})
    assert out.returncode == 0 and Path(out.stdout.strip()).parent == nixos
    chosen = run_wrapper(tmp_path, [nixos], "readlink \"${LD_LIBRARY_PATH%%:*}/libcuda.so.1\"; "
                         "echo $LD_LIBRARY_PATH; echo $TRITON_LIBCUDA_PATH",
                         env={"DSPARK_DRIVER_LIB_DIR": str(ubuntu), "LD_LIBRARY_PATH": "/opt/keep",
                              "TRITON_LIBCUDA_PATH": "/set/by/unit"})
    target, ld, triton = chosen.stdout.split()
    assert Path(target).parent == ubuntu and ld.endswith(":/opt/keep") and triton == "/set/by/unit"


def test_two_wrappers_starting_together_share_one_link_dir(tmp_path):
    ubuntu = driver_dir(tmp_path / "usr-lib")
    procs = [subprocess.Popen(["bash", "-c", f"source '{SCRIPT}' '{' '.join(BUILD['driver_libraries'])}' '{ubuntu}' "
                               f"'{' '.join(BUILD['driver_library_globs'])}'; echo ${{LD_LIBRARY_PATH%%:*}}"],
                              env={"PATH": os.environ["PATH"], "XDG_CACHE_HOME": str(tmp_path / "cache")},
                              stdout=subprocess.PIPE, text=True) for _ in range(6)]
    dirs = {p.communicate(timeout=60)[0].strip() for p in procs}
    assert len(dirs) == 1 and all(p.returncode == 0 for p in procs)
    base = tmp_path / "cache" / "dspark-runtime"
    assert [p.name for p in base.iterdir()] == [Path(dirs.pop()).name]  # no half-made leftovers
