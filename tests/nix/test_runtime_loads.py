"""Libraries the runtime loads itself (dlopen by soname, outside DT_NEEDED) and the RPATH the Nix
build gives each object.

nix/replay_runtime/checks.py checks every soname an object names in its strings or .note.dlopen table
against the RPATH autoPatchelf leaves it. Here: that check on objects built here (everywhere), on
the locked NCCL wheel (where the wheels are cached), the real dynamic loader resolving a
dlopen'd soname through the RPATH the build gives and through nothing else (gcc, patchelf and
Debian's rdma-core libraries unpacked by .ci/setup), and runtime.nix passing the build data's
append_runpath libraries to autoPatchelf (Nix evaluation).
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.nix.nix_support import REPO, nix_eval
from tests.nix.test_replay import BUILD, CACHE, cached, installer, rr

pytestmark = pytest.mark.nix

DEBIAN_RDMA = REPO / ".venv/pinned/debian-rdma-core/lib"
HOST_MACHINE = rr.elf.read_elf(Path(sys.executable).resolve()).machine


def without_append_runpath() -> dict:
    """runtime-build.json as it was before the fix: rdma-core a buildInput only."""
    old = copy.deepcopy(BUILD)
    for lib in old["host_libraries"]:
        lib.pop("append_runpath", None)
    return old


def need(*tools: str) -> None:
    missing = [t for t in tools if shutil.which(t) is None]
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed (.ci/setup --system installs them)")


def build_object(tmp: Path, out: Path, soname: str, dlopens: list[str], links: list[Path] = ()) -> Path:
    """A shared object of this machine, built here, that dlopens each of `dlopens` by name from
    its own code (so that glibc searches its RUNPATH) and links `links` (DT_NEEDED)."""
    src = tmp / f"{soname}.c"
    names = ", ".join(json.dumps(n) for n in dlopens)
    src.write_text(f"""
#include <dlfcn.h>
#include <stdio.h>
static const char *names[] = {{ {names}, 0 }};
int probe(const char *name) {{
  void *h = dlopen(name, RTLD_NOW | RTLD_LOCAL);
  if (!h) {{ printf("FAIL %s\\n", dlerror()); fflush(stdout); return 1; }}
  printf("OK %s\\n", name); fflush(stdout); return 0;
}}
const char **probe_names(void) {{ return names; }}
""")
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = ["gcc", "-shared", "-fPIC", "-Wl,--no-as-needed", f"-Wl,-soname,{soname}", "-o", str(out), str(src), "-ldl"]
    for lib in links:
        cmd += [f"-L{lib.parent}", f"-l:{lib.name}"]
    subprocess.run(cmd, check=True, capture_output=True, timeout=120)
    return out


# ---------------------------------------------------------------- the check, on objects built here

def test_strings_and_dlopen_notes_are_read_from_a_built_object(tmp_path):
    need("gcc")
    obj = build_object(tmp_path, tmp_path / "p/lib/libnet.so.2", "libnet.so.2",
                       ["libibverbs.so", "libibverbs.so.1", "libmlx5.so.1", "libcuda.so.1"])
    names = rr.elf.named_sonames(obj)
    assert {"libibverbs.so", "libibverbs.so.1", "libmlx5.so.1", "libcuda.so.1", "libnet.so.2"} <= names
    # A name inside a message is not a name the object loads.
    msg = build_object(tmp_path, tmp_path / "m/libmsg.so", "libmsg.so", ["Failed to open libgdrapi.so.2"])
    assert "libgdrapi.so.2" not in rr.elf.named_sonames(msg)
    # A .note.dlopen table (systemd's ELF dlopen metadata), added with objcopy when there is one.
    if shutil.which("objcopy"):
        note = tmp_path / "note.bin"
        desc = json.dumps([{"soname": ["libfoo.so.3", "libfoo.so.2"], "feature": "x"}]).encode() + b"\0"
        desc += b"\0" * (-len(desc) % 4)
        note.write_bytes(len(b"FDO\0").to_bytes(4, "little") + len(desc).to_bytes(4, "little")
                         + (0x407C0C0A).to_bytes(4, "little") + b"FDO\0" + desc)
        subprocess.run(["objcopy", "--add-section", f".note.dlopen={note}",
                        "--set-section-flags", ".note.dlopen=alloc,readonly", str(obj)], check=True, timeout=60)
        assert rr.elf.read_elf(obj).dlopen_notes == [["libfoo.so.3", "libfoo.so.2"]]


def test_nccl_shaped_object_fails_before_the_fix_and_resolves_with_append_runpath(tmp_path):
    """An object that dlopens libibverbs/libmlx5 by soname and lists only libc as needed:
    unresolved with rdma-core a buildInput only; resolved once rdma-core is on every RPATH."""
    need("gcc")
    prefix = tmp_path / "p"
    build_object(tmp_path, prefix / "nvidia/nccl/lib/libnccl.so.2", "libnccl.so.2",
                 ["libibverbs.so", "libibverbs.so.1", "libmlx5.so.1", "libcuda.so.1", "libnvidia-ml.so.1"])
    elves = rr.elf.elf_objects(prefix)
    before = rr.checks.check_runtime_loads(elves, prefix, without_append_runpath(), machine=HOST_MACHINE)
    assert before.unresolved == ["nvidia/nccl/lib/libnccl.so.2: libibverbs.so.1 / libibverbs.so",
                                 "nvidia/nccl/lib/libnccl.so.2: libmlx5.so.1"]
    assert before.driver == ["nvidia/nccl/lib/libnccl.so.2: libcuda.so.1",
                             "nvidia/nccl/lib/libnccl.so.2: libnvidia-ml.so.1"]
    after = rr.checks.check_runtime_loads(elves, prefix, BUILD, machine=HOST_MACHINE)
    assert after.unresolved == []
    assert after.resolved == ["nvidia/nccl/lib/libnccl.so.2: libibverbs.so.1 / libibverbs.so -> nixpkgs rdma-core",
                              "nvidia/nccl/lib/libnccl.so.2: libmlx5.so.1 -> nixpkgs rdma-core"]
    assert (after.objects, after.checked) == (1, 4)


def test_a_dlopen_resolves_through_the_directory_of_a_resolved_needed(tmp_path):
    """autoPatchelf puts the directory of each resolved DT_NEEDED on the RPATH: a library dlopen'd
    from that directory resolves, one elsewhere in the output does not, unless listed absent."""
    need("gcc")
    prefix = tmp_path / "p"
    dep = build_object(tmp_path, prefix / "a/libdep.so.1", "libdep.so.1", ["libnothing.so.9"])
    build_object(tmp_path, prefix / "a/libsib.so.1", "libsib.so.1", ["libnothing.so.9"])
    build_object(tmp_path, prefix / "b/libfar.so.1", "libfar.so.1", ["libnothing.so.9"])
    build_object(tmp_path, prefix / "c/libuser.so", "libuser.so", ["libsib.so.1", "libfar.so.1"], links=[dep])
    elves = rr.elf.elf_objects(prefix)
    user = next(e for e in elves if e.path.name == "libuser.so")
    assert "libdep.so.1" in user.needed
    check = rr.checks.check_runtime_loads([user], prefix, BUILD, machine=HOST_MACHINE)
    assert check.resolved == ["c/libuser.so: libsib.so.1 -> a"]
    assert check.unresolved == ["c/libuser.so: libfar.so.1"]
    listed = copy.deepcopy(BUILD)
    listed.setdefault("dlopen_absent", []).append({"sonames": ["libfar.so.1"], "objects": ["/libother.so"],
                                                   "why": "test"})
    check = rr.checks.check_runtime_loads([user], prefix, listed, machine=HOST_MACHINE)
    assert check.unresolved == ["c/libuser.so: libfar.so.1"]
    listed["dlopen_absent"][-1]["objects"] = ["/libuser.so"]
    check = rr.checks.check_runtime_loads([user], prefix, listed, machine=HOST_MACHINE)
    assert check.unresolved == [] and check.absent == ["c/libuser.so: libfar.so.1"]


# ---------------------------------------------------------------- the real dynamic loader

def loader_run(probe: Path, name: str, tmp: Path) -> tuple[str, str]:
    """dlopen `name` from inside `probe` (a child Python, LD_DEBUG=libs): its stdout, and the
    loader's account of the search."""
    debug = tmp / f"ld-{probe.parent.name}"
    env = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "LD_PRELOAD")}
    env.update(LD_DEBUG="libs", LD_DEBUG_OUTPUT=str(debug))
    code = "import ctypes, sys; sys.exit(ctypes.CDLL(sys.argv[1]).probe(sys.argv[2].encode()))"
    proc = subprocess.run([sys.executable, "-c", code, str(probe), name], env=env, capture_output=True,
                          text=True, timeout=120)
    trace = "".join(p.read_text(errors="replace") for p in sorted(tmp.glob(f"{debug.name}.*")))
    return proc.stdout, trace


def test_the_loader_finds_rdma_core_only_through_the_rpath_the_build_gives(tmp_path):
    """A NCCL-shaped object (dlopens libibverbs.so.1 and libmlx5.so.1 from its own code, needs
    neither) with the RUNPATH autoPatchelf leaves it: the build data's appended runpaths, with
    rdma-core's lib/ standing for a directory of this test's own that holds Debian's real
    libibverbs and libmlx5. Before the fix the loader does not find them, after it does, and
    LD_DEBUG shows the object's RUNPATH as where it found them."""
    need("gcc", "patchelf")
    if not (DEBIAN_RDMA / "libibverbs.so.1").exists():
        pytest.skip(f"{DEBIAN_RDMA} missing: .ci/setup unpacks Debian's libibverbs1 and ibverbs-providers there")
    cache = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
    if "libibverbs.so.1" in cache:
        pytest.skip("libibverbs is installed on this host, so the loader would find it without any RPATH")
    # rdma-core's lib/ as the store has it: the libraries, each finding its own libnl beside it
    # (the store's rdma-core has its libnl on its RUNPATH).
    rdma = tmp_path / "rdma-core/lib"
    rdma.mkdir(parents=True)
    for f in DEBIAN_RDMA.iterdir():
        shutil.copy(f, rdma / f.name, follow_symlinks=True)
    for name in ("libibverbs.so.1", "libmlx5.so.1", "libnl-route-3.so.200"):
        subprocess.run(["patchelf", "--set-rpath", "$ORIGIN", str(rdma / name)], check=True, timeout=60)

    def runpath(build: dict) -> str:
        dirs = {"driver": BUILD["driver_search_dirs"][0], "nixpkgs rdma-core": str(rdma), "$ORIGIN": "$ORIGIN"}
        return ":".join(dirs[d] for d in rr.checks.build_runpaths(build))

    results = {}
    for label, build in (("before", without_append_runpath()), ("after", BUILD)):
        probe = build_object(tmp_path, tmp_path / label / "libnccl.so.2", "libnccl.so.2",
                             ["libibverbs.so.1", "libmlx5.so.1"])
        subprocess.run(["patchelf", "--set-rpath", runpath(build), str(probe)], check=True, timeout=60)
        results[label] = {name: loader_run(probe, name, tmp_path) for name in ("libibverbs.so.1", "libmlx5.so.1")}
    for name in ("libibverbs.so.1", "libmlx5.so.1"):
        out, trace = results["before"][name]
        assert out.startswith(f"FAIL {name}: cannot open shared object file"), out
        assert str(rdma) not in trace
        out, trace = results["after"][name]
        assert out == f"OK {name}\n", out
        search = re.search(rf"find library={re.escape(name)} \[0\]; searching\n(.*?)\n\s*\d+:\s*\n", trace, re.S)
        assert search, trace[-2000:]
        assert re.search(rf"search path=[^\n]*{re.escape(str(rdma))}[:\s][^\n]*\(RUNPATH from file "
                         rf"{re.escape(str(tmp_path / 'after' / 'libnccl.so.2'))}\)", search.group(1)), search.group(1)
        assert f"trying file={rdma}/{name}" in search.group(1)
        assert re.search(rf"calling init: {re.escape(str(rdma))}/{re.escape(name)}", trace)


# ---------------------------------------------------------------- the locked NCCL wheel

def test_locked_nccl_dlopens_ibverbs_and_mlx5_and_the_build_now_resolves_them(tmp_path):
    wheels = cached("nvidia-nccl-cu13")
    prefix = tmp_path / "nccl"
    assert rr.wheels.install(prefix, wheels, CACHE, BUILD, installer(), log=lambda _: None) == []
    elves = rr.elf.elf_objects(prefix)
    nccl = next(e for e in elves if e.path.name == "libnccl.so.2")
    assert not {"libibverbs.so.1", "libmlx5.so.1"} & set(nccl.needed)
    site = rr.wheels.site_packages(prefix).relative_to(prefix)
    rel = f"{site}/nvidia/nccl/lib/libnccl.so.2"
    before = rr.checks.check_runtime_loads(elves, prefix, without_append_runpath())
    # NCCL tries the unversioned name first, then the versioned one ("libibverbs.so[.1]").
    assert f"{rel}: libibverbs.so.1 / libibverbs.so" in before.unresolved
    assert f"{rel}: libmlx5.so.1 / libmlx5.so" in before.unresolved
    after = rr.checks.check_runtime_loads(elves, prefix, BUILD)
    assert after.unresolved == []
    assert f"{rel}: libibverbs.so.1 / libibverbs.so -> nixpkgs rdma-core" in after.resolved
    assert f"{rel}: libmlx5.so.1 / libmlx5.so -> nixpkgs rdma-core" in after.resolved


# ---------------------------------------------------------------- runtime.nix passes it to autoPatchelf

def test_runtime_nix_appends_rdma_core_to_every_runpath(nix_instantiate, nixpkgs_lib, tmp_path):
    stub = tmp_path / "stub"
    stub.mkdir()
    shutil.copy(REPO / "tests/nix/stub-nixpkgs/default.nix", stub / "default.nix")
    (stub / "lib-path.nix").write_text(json.dumps(str(nixpkgs_lib)) + "\n")
    out = nix_eval(nix_instantiate, f"""
      let
        pkgs = import {stub} {{ config.allowUnfree = true; }};
        drv = pkgs.callPackage ./nix/runtime.nix {{ }};
      in drv.appendRunpaths""")
    # The replay's model of the same list (build_runpaths), in the same order.
    assert out == ["/run/opengl-driver/lib", "/nix/store/00000000000000000000000000000000-rdma-core/lib", "$ORIGIN"]
    assert rr.checks.build_runpaths(BUILD) == ["driver", "nixpkgs rdma-core", "$ORIGIN"]
