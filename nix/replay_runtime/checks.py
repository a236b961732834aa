"""The checks on an installed prefix: what would stop the Nix build (a DT_NEEDED autoPatchelf
cannot resolve, a load segment glibc would refuse after `strip -S`) or the runtime (a library
loaded at run time that the build leaves unresolvable, a module importable only through a .pth
file the interpreter does not process)."""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .elf import EM_AARCH64, Elf, named_sonames, read_elf
from .plan import ReplayError

PAGE_SIZE = 4096  # the GB10 nodes' kernel (DGX OS, NixOS) uses 4 KiB pages; p_align is checked too


# ---------------------------------------------------------------- DT_NEEDED, as autoPatchelf resolves it

def provided_by_build(build: dict[str, Any]) -> dict[str, str]:
    """Library name -> what provides it, besides the prefix: the nixpkgs libraries and the driver."""
    out = {}
    for lib in build["host_libraries"]:
        for so in lib["sonames"]:
            out[so] = f"nixpkgs {lib['attr']}"
    for so in build["driver_libraries"]:
        out[so] = "the NVIDIA driver (host)"
    return out


def unresolved_needed(elves: list[Elf], prefix: Path, build: dict[str, Any]) -> list[str]:
    """DT_NEEDED entries autoPatchelf could not resolve: it searches every shared object of the
    output by file name (same machine), the buildInputs' lib/ and ignores the named driver libraries."""
    in_prefix = {e.path.name for e in elves if ".so" in e.path.name and e.machine == EM_AARCH64}
    # Links to objects (libfoo.so.1 -> libfoo.so.1.2.3) count by their own name too.
    for root, _, files in os.walk(prefix):
        for name in files:
            p = Path(root) / name
            if ".so" in name and p.is_symlink() and p.exists():
                in_prefix.add(name)
    known = provided_by_build(build)
    out = []
    for e in elves:
        if e.type not in (2, 3):  # executables and shared objects only, as autoPatchelf
            continue
        if e.machine != EM_AARCH64:
            out.append(f"{e.path.relative_to(prefix)}: not an aarch64 object (e_machine {e.machine})")
            continue
        for lib in e.needed:
            if lib not in in_prefix and lib not in known:
                out.append(f"{e.path.relative_to(prefix)}: {lib}")
        for alternatives in e.dlopen_notes:
            if not any(lib in in_prefix or lib in known for lib in alternatives):
                out.append(f"{e.path.relative_to(prefix)}: any of {', '.join(alternatives)} (.note.dlopen)")
    return out



# ---------------------------------------------------------------- libraries loaded at run time

AUDITWHEEL_HASH = re.compile(r"[-.][0-9a-f]{8}$")


def stem(name: str) -> str:
    """A library's name without its .so suffix and any hashes auditwheel or delvewheel added:
    libgfortran-daac5196-038a5e3c.so.5.0.0 -> libgfortran."""
    base = name.split(".so", 1)[0]
    while (shorter := AUDITWHEEL_HASH.sub("", base)) != base:
        base = shorter
    return base


def dependency_groups(names: set[str]) -> list[list[str]]:
    """One dependency per library: "libibverbs.so" and "libibverbs.so.1" in one object are the
    names it tries for one library (NCCL: "Failed to open libibverbs.so[.1]")."""
    groups: dict[str, list[str]] = {}
    for name in sorted(names, key=lambda n: (n.split(".so", 1)[0], -len(n))):
        groups.setdefault(name.split(".so", 1)[0], []).append(name)
    return list(groups.values())


@dataclass
class LoadCheck:
    """What happens to each library an object names outside its DT_NEEDED."""
    objects: int = 0
    checked: int = 0
    resolved: list[str] = field(default_factory=list)
    glibc: list[str] = field(default_factory=list)
    driver: list[str] = field(default_factory=list)
    absent: list[str] = field(default_factory=list)
    unresolved: list[str] = field(default_factory=list)

    def summary(self) -> str:
        loaded = sum("-> already loaded" in r for r in self.resolved)
        return (f"{self.checked} libraries named outside DT_NEEDED in {self.objects} objects: "
                f"{len(self.resolved) - loaded} resolve through the object's RPATH, {loaded} are already "
                f"loaded (its DT_NEEDED closure or runtime-build.json preloaded), {len(self.glibc)} glibc's, "
                f"{len(self.driver)} the driver's, {len(self.absent)} deliberately absent "
                f"(runtime-build.json dlopen_absent), {len(self.unresolved)} unresolved")


def build_runpaths(build: dict[str, Any]) -> list[str]:
    """What runtime.nix appends to every object's RPATH (appendRunpaths): the driver's directory,
    the lib/ of each host library marked append_runpath, and runtime-build.json's
    append_runpaths ("$ORIGIN": the object's own directory)."""
    return (["driver"] + [f"nixpkgs {lib['attr']}" for lib in build["host_libraries"] if lib.get("append_runpath")]
            + [entry["path"] for entry in build.get("append_runpaths", [])])


def on_runpath(so: str, sure: set[str], either: list[set[str]], in_dir: dict[str, set[str]]) -> str | None:
    """The directory of an object's RUNPATH (`sure` entries, else a set of candidates that all hold
    it) where `so` is found, if any."""
    hit = sorted(d for d in sure if so in in_dir.get(d, ()))
    if hit:
        return hit[0]
    for cands in either:
        if all(so in in_dir.get(d, ()) for d in cands):
            return sorted(cands)[0]
    return None


def check_runtime_loads(elves: list[Elf], prefix: Path, build: dict[str, Any],
                        machine: int = EM_AARCH64) -> LoadCheck:
    """For every aarch64 object, each library it names (strings, .note.dlopen) and does not list
    as DT_NEEDED must be found where glibc's dlopen from that object looks, as the Nix build
    leaves it: the object's RUNPATH, which autoPatchelf sets to the directory of each resolved
    DT_NEEDED and .note.dlopen entry (the first file of that name in the output, else the
    buildInputs' lib/), plus appendRunpaths (the driver's /run/opengl-driver/lib, and
    runtime-build.json's append_runpath libraries); then LD_LIBRARY_PATH, which the vllm wrapper
    sets to the driver's libraries only; then glibc's own directory (the store's glibc reads no
    /etc/ld.so.cache). Else it must be listed in dlopen_absent with the reason."""
    dirs_of: dict[str, set[str]] = {}
    for root, _, files in os.walk(prefix):
        for name in files:
            p = Path(root) / name
            if ".so" not in name or not p.exists():
                continue
            if not p.is_symlink():
                e = read_elf(p)
                if e is None or e.machine != machine:
                    continue
            dirs_of.setdefault(name, set()).add(str(p.parent.relative_to(prefix)))
    host_dir: dict[str, str] = {}
    in_dir: dict[str, set[str]] = {}
    glibc = set()
    for lib in build["host_libraries"]:
        d = f"nixpkgs {lib['attr']}"
        for so in lib["sonames"]:
            host_dir.setdefault(so, d)
            in_dir.setdefault(d, set()).add(so)
        if lib.get("in_stdenv"):
            glibc.update(lib["sonames"])
    for name, ds in dirs_of.items():
        for d in ds:
            in_dir.setdefault(d, set()).add(name)
    appended = build_runpaths(build)
    driver_globs = build["driver_library_globs"] + build["driver_libraries"]
    absent = build.get("dlopen_absent", [])
    versioned = build.get("dlopen_versioned", [])
    by_path = {e.path: e for e in elves}

    def closure(e: Elf) -> set[str]:
        """Every soname loaded with `e`: its DT_NEEDED, theirs, ... (within the output)."""
        seen: set[str] = set()
        todo = list(e.needed)
        while todo:
            lib = todo.pop()
            if lib in seen:
                continue
            seen.add(lib)
            for d in sorted(dirs_of.get(lib, ())):
                dep = by_path.get(prefix / d / lib) or by_path.get((prefix / d / lib).resolve())
                if dep is not None:
                    todo += dep.needed
                    if dep.soname:
                        seen.add(dep.soname)
                    break
        return seen

    # What every process of the runtime has loaded before anything dlopens (runtime-build.json
    # preloaded: torch's CUDA library, which `import torch` loads, and its DT_NEEDED closure).
    preloaded: set[str] = set()
    for entry in build.get("preloaded", []):
        for e in elves:
            if e.path.relative_to(prefix).as_posix().endswith(entry["object"]):
                preloaded |= closure(e) | {e.soname or e.path.name}
    out = LoadCheck()
    for e in elves:
        if e.type not in (2, 3) or e.machine != machine:
            continue
        # Its own names and those of what it links, also as auditwheel had them before renaming
        # (patchelf --replace-needed leaves the old name in .dynstr): not libraries it loads.
        own = {e.path.name, e.soname, *e.needed}
        own_stems = {stem(n) for n in own if n}
        named = {n for n in named_sonames(e.path) if n not in own and stem(n) not in own_stems}
        groups = dependency_groups(named)
        groups += [g for g in e.dlopen_notes if not any(n in own for n in g)]
        if not groups:
            continue
        loaded = closure(e) | preloaded
        out.objects += 1
        # The object's RUNPATH after autoPatchelf: sure entries, and for a name the output holds
        # in several directories (autoPatchelf takes the first it found) the set of candidates.
        here = str(e.path.parent.relative_to(prefix))
        sure: set[str] = {here if d == "$ORIGIN" else d for d in appended}
        either: list[set[str]] = []
        for lib in [*e.needed, *(n for g in e.dlopen_notes for n in g)]:
            if lib in glibc:
                continue  # autoPatchelf leaves libc's libraries to the loader's default path
            candidates = dirs_of.get(lib) or ({host_dir[lib]} if lib in host_dir else set())
            if len(candidates) == 1:
                sure |= candidates
            elif candidates:
                either.append(candidates)
        rel = e.path.relative_to(prefix)
        for group in groups:
            out.checked += 1
            label = f"{rel}: {' / '.join(group)}"
            # A library that appends its major version to the name it holds (cuDNN: "libcudnn_graph.so"
            # + ".9"): the versioned name is looked for too.
            group = group + [so + v["append"] for so in group for v in versioned
                             if fnmatch.fnmatchcase(so, v["names"]) and rel.as_posix().endswith(tuple(v["objects"]))]
            found = next(((so, where) for so in group if (where := on_runpath(so, sure, either, in_dir))), None)
            if found:
                out.resolved.append(f"{label} -> {found[1]}")
            elif any(so in glibc for so in group):
                out.glibc.append(label)
            elif any(so in loaded for so in group):
                # glibc's dlopen returns an object already loaded under that soname.
                why = "its DT_NEEDED closure" if any(so in loaded - preloaded for so in group) else "preloaded"
                out.resolved.append(f"{label} -> already loaded ({why})")
            elif any(fnmatch.fnmatchcase(so, g) for so in group for g in driver_globs):
                out.driver.append(label)
            elif any(so in entry["sonames"] and rel.as_posix().endswith(tuple(entry["objects"]))
                     for entry in absent for so in group):
                out.absent.append(label)
            else:
                out.unresolved.append(label)
    return out


# ---------------------------------------------------------------- load segments, as installed and after strip

def misaligned(elf: Elf) -> str | None:
    """glibc's checks on PT_LOAD (dl-load.c): alignment a power of two and page-aligned, and
    p_vaddr ≡ p_offset modulo it."""
    for off, vaddr, align in elf.loads:
        if align > 1 and (align & (align - 1) or align % PAGE_SIZE):
            return f"load segment alignment {align:#x} is not page-aligned"
        if align > 1 and (vaddr - off) % align:
            return f"load segment at offset {off:#x} / address {vaddr:#x} is not aligned to {align:#x}"
        if (vaddr - off) % PAGE_SIZE:
            return f"load segment at offset {off:#x} / address {vaddr:#x} is not page-aligned"
    return None


def strip_tool() -> str | None:
    for name in (os.environ.get("STRIP"), "aarch64-linux-gnu-strip"):
        if name and shutil.which(name):
            return shutil.which(name)
    if os.uname().machine == "aarch64":
        return shutil.which("strip")
    return None


def strip_breaks(elves: list[Elf], prefix: Path, build: dict[str, Any],
                 strip: str | None = None) -> list[str]:
    """Objects glibc would refuse to load: as installed, and after `strip -S` when the build strips."""
    out = []
    for e in elves:
        if e.type == 3 and (why := misaligned(e)):
            out.append(f"{e.path.relative_to(prefix)}: {why} (as installed)")
    if not build["strip"]:
        return out
    strip = strip or strip_tool()
    if strip is None:
        raise ReplayError("runtime-build.json says the build strips, but no aarch64 strip was found "
                          "(apt-get install binutils-aarch64-linux-gnu, or set STRIP)")
    with tempfile.TemporaryDirectory() as tmp:
        for e in elves:
            if e.type != 3 or e.machine != EM_AARCH64:
                continue
            copy = Path(tmp) / "obj"
            shutil.copyfile(e.path, copy)
            if subprocess.run([strip, "-S", str(copy)], capture_output=True).returncode != 0:
                continue  # nixpkgs' stripHook ignores objects strip cannot handle
            after = read_elf(copy)
            if after is not None and (why := misaligned(after)):
                out.append(f"{e.path.relative_to(prefix)}: {why} after strip -S")
    return out


# ---------------------------------------------------------------- .pth files

def pth_paths(site: Path, python: Path) -> dict[str, list[Path]]:
    """Each .pth file in site-packages and the directories it adds to sys.path, as site.py would
    process it (its `import` lines run: nvidia_cutlass_dsl_packages.pth computes its directory)."""
    code = ("import json, site, sys; site_dir, name = sys.argv[1:]; sys.path.insert(0, site_dir); "
            "before = set(sys.path); site.addpackage(site_dir, name, None); "
            "print(json.dumps([p for p in sys.path if p not in before]))")
    out = {}
    for pth in sorted(site.glob("*.pth")):
        proc = subprocess.run([str(python), "-S", "-c", code, str(site), pth.name],
                              capture_output=True, text=True, env={"PATH": os.environ.get("PATH", "")})
        if proc.returncode != 0:
            raise ReplayError(f"{pth.name}: site.py could not process it: {proc.stderr.strip()[-300:]}")
        out[pth.name] = [Path(d).resolve() for d in json.loads(proc.stdout.strip().splitlines()[-1])
                         if Path(d).is_dir()]
    return out


def pth_imports(site: Path, python: Path, env: dict[str, str] | None = None) -> list[str]:
    """Top-level modules that exist only in a .pth file's directory and that `python` (as the
    runtime starts it) does not put on sys.path."""
    env = dict(os.environ if env is None else env)
    proc = subprocess.run([str(python), "-c", "import json, sys; print(json.dumps(sys.path))"],
                          env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise ReplayError(f"{python} does not start: {proc.stderr.strip()[-300:]}")
    on_path = {str(Path(p).resolve()) for p in json.loads(proc.stdout) if p}
    out = []
    for pth, dirs in pth_paths(site, python).items():
        for d in dirs:
            if str(d) in on_path:
                continue
            mods = sorted(p.name.split(".")[0] for p in d.iterdir()
                          if (p.is_dir() and (p / "__init__.py").exists()) or p.suffix in (".py", ".so"))
            out.append(f"{pth}: {d} ({', '.join(mods) or 'no modules'}) is not on sys.path, "
                       f"so `import {mods[0] if mods else '...'}` fails")
    return out

