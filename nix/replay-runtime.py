#!/usr/bin/env python3
"""Replay nix/runtime.nix's build of the GB10 runtime without nixpkgs, and report what would stop it.

    python3 nix/replay-runtime.py --cache ~/.cache/dspark/runtime-wheels    # about 4 GB the first time
    python3 nix/replay-runtime.py --line v0.32.0 --cache ...                # another runtime line

It reads what the Nix build of a runtime line reads (the line in src/dspark/data/runtime_lines.toml,
as nix/lines.nix does: its lock, nix/runtime-lock.json for the default line, and its overlay
series; nix/runtime-build.json for every line), then:
1. fetches every locked wheel by name, version and sha256 into the cache directory (pip, with
   --require-hashes, for the nodes' platform), and installer itself at the release nixpkgs has;
2. makes the prefix a venv of this machine's Python, as runtime.nix does with the store's CPython,
   and installs the wheels with `python -m installer` in the lock's order with the same flags,
   removing what runtime-build.json removes after each package;
3. reports: files two wheels both install (installer refuses to overwrite); every DT_NEEDED of
   every ELF object that neither the prefix, nor the nixpkgs libraries runtime-build.json lists,
   nor the named driver libraries provide (what autoPatchelf stops on); modules that are only
   importable through a .pth file and that the prefix's interpreter does not put on sys.path;
   objects whose load segments glibc would refuse, as installed or (when the build strips)
   after `strip -S`; and every library an object names in its strings (a `dlopen` argument:
   NCCL's "libibverbs.so.1") or its .note.dlopen table without listing it as DT_NEEDED, unless
   it resolves through the RPATH autoPatchelf gives that object, is glibc's, is the driver's
   (on /run/opengl-driver/lib and the wrappers' LD_LIBRARY_PATH), or runtime-build.json lists
   it in dlopen_absent with the reason;
4. applies the line's overlay series to the installed vLLM with nix/apply-overlay.py, as the build
   does, and reports a patch that does not apply.
Exit status: 0 clean, 1 any problem above, 2 bad input (nothing fetched, a wrong hash, no tool).
Standard library only; x86_64 or aarch64 host.
"""

from __future__ import annotations

import argparse
import configparser
import fnmatch
import hashlib
import json
import mmap
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

HERE = Path(__file__).resolve().parent
LOCK = HERE / "runtime-lock.json"
BUILD = HERE / "runtime-build.json"
LINES = HERE.parent / "src" / "dspark" / "data" / "runtime_lines.toml"
APPLY_OVERLAY = HERE / "apply-overlay.py"
DEFAULT_CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dspark" / "runtime-wheels"
EM_AARCH64 = 183
PAGE_SIZE = 4096  # the GB10 nodes' kernel (DGX OS, NixOS) uses 4 KiB pages; p_align is checked too


class ReplayError(Exception):
    """Bad input or a missing tool: reported as one line, exit status 2."""


# ---------------------------------------------------------------- plan: the data the .nix files read

@dataclass(frozen=True)
class Wheel:
    name: str
    version: str
    filename: str
    sha256: str


def load_plan(lock_path: Path = LOCK, build_path: Path = BUILD) -> tuple[list[Wheel], dict]:
    """The wheels in the order runtime.nix installs them (the lock's order), and the build data."""
    try:
        lock = json.loads(lock_path.read_text())
        build = json.loads(build_path.read_text())
        wheels = [Wheel(p["name"], p["version"], p["filename"], p["sha256"]) for p in lock["packages"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ReplayError(f"cannot read {lock_path.name} / {build_path.name}: {e}") from e
    return wheels, build


@dataclass(frozen=True)
class Line:
    """One runtime line as nix/lines.nix reads it for the build."""

    id: str
    vllm: str
    lock: Path
    series: tuple[Path, ...]  # the patches, in order


def read_series_file(path: Path) -> tuple[Path, ...]:
    """A series file as dspark.overlay and nix/lines.nix read it: one patch a line, a path relative
    to the file's folder; blank and `#` lines skipped."""
    entries = [s.strip() for s in path.read_text().splitlines()]
    series = tuple((path.parent / e).resolve() for e in entries if e and not e.startswith("#"))
    missing = [str(p) for p in series if not p.is_file()]
    if missing:
        raise ReplayError(f"{path} names {missing[0]}, which is not there")
    return series


def load_line(line_id: str | None = None, lines_path: Path = LINES, repo: Path = HERE.parent) -> Line:
    """The line (default: the data's default line) as nix/lines.nix reads it: its lock, and its
    series, read from its `series_file` (or, without one, its `series.applies` from overlay/)."""
    try:
        data = tomllib.loads(lines_path.read_text())
        line_id = line_id or data["default"]
        if line_id not in data["lines"]:
            raise ReplayError(f"{line_id!r} is not a runtime line; known: {', '.join(sorted(data['lines']))}")
        raw = data["lines"][line_id]
        if raw["lock_state"] != "locked":
            raise ReplayError(f"runtime line {line_id} has no complete lock (lock_state {raw['lock_state']!r})")
        if "series_file" in raw:
            series = read_series_file(repo / raw["series_file"])
        else:
            series = tuple(repo / "overlay" / n for n in raw.get("series", {}).get("applies", []))
        return Line(line_id, raw["vllm"], repo / raw["lock"], series)
    except (OSError, tomllib.TOMLDecodeError, KeyError, TypeError) as e:
        raise ReplayError(f"cannot read the runtime lines from {lines_path}: {e}") from e


def installer_wheel(build: dict) -> Wheel:
    i = build["installer"]
    return Wheel(i["name"], i["version"], i["filename"], i["sha256"])


# ---------------------------------------------------------------- fetch

def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def pip_platform_args(lock: dict | None = None) -> list[str]:
    """pip's target for the nodes: CPython 3.12, aarch64, manylinux up to glibc 2.39."""
    args = ["--python-version", "3.12", "--implementation", "cp",
            "--abi", "cp312", "--abi", "abi3", "--abi", "none"]
    for minor in range(39, 16, -1):
        args += ["--platform", f"manylinux_2_{minor}_aarch64"]
    return args + ["--platform", "manylinux2014_aarch64", "--platform", "linux_aarch64"]


def missing_from_cache(cache: Path, wheels: list[Wheel]) -> list[Wheel]:
    missing = []
    for w in wheels:
        path = cache / w.filename
        if not path.is_file():
            missing.append(w)
        elif sha256_of(path) != w.sha256:
            raise ReplayError(f"{path}: sha256 is not the locked {w.sha256}; delete the file and run again")
    return missing


def fetch(cache: Path, wheels: list[Wheel], offline: bool, log=print) -> None:
    """Every wheel into the cache, by name, version and hash (pip only accepts the locked file)."""
    cache.mkdir(parents=True, exist_ok=True)
    missing = missing_from_cache(cache, wheels)
    if not missing:
        return
    if offline:
        raise ReplayError(f"{len(missing)} of {len(wheels)} wheels are not in {cache} "
                          f"(first: {missing[0].filename}); run without --offline to fetch them")
    log(f"fetching {len(missing)} wheels into {cache}")
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as req:
        for w in missing:
            req.write(f"{w.name}=={w.version} --hash=sha256:{w.sha256}\n")
    try:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--require-hashes", "--progress-bar", "off", "-d", str(cache), "-r", req.name,
               *pip_platform_args()]
        proc = subprocess.run(cmd, capture_output=True, text=True)
    finally:
        os.unlink(req.name)
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-5:])
        raise ReplayError(f"pip download failed (is pip installed for {sys.executable}?):\n{tail}")
    still = missing_from_cache(cache, wheels)
    if still:
        raise ReplayError(f"pip did not fetch {', '.join(w.filename for w in still)}")


# ---------------------------------------------------------------- install, as runtime.nix does

def wheel_destinations(path: Path) -> list[str]:
    """Where installer puts a wheel's files, relative to the prefix ('site/...' for site-packages)."""
    with zipfile.ZipFile(path) as z:
        names = [n for n in z.namelist() if not n.endswith("/")]
        entry_points = next((n for n in names if n.endswith(".dist-info/entry_points.txt")
                             and n.count("/") == 1), None)
        scripts: list[str] = []
        if entry_points:
            cp = configparser.ConfigParser(delimiters=("=",), interpolation=None)
            cp.optionxform = str
            cp.read_string(z.read(entry_points).decode())
            for section in ("console_scripts", "gui_scripts"):
                if cp.has_section(section):
                    scripts += [f"bin/{k}" for k in cp[section]]
    out = []
    for n in names:
        parts = PurePosixPath(n).parts
        if parts[0].endswith(".data") and len(parts) > 2:
            scheme, rest = parts[1], "/".join(parts[2:])
            out.append({"purelib": "site/", "platlib": "site/", "scripts": "bin/", "data": "",
                        "headers": "include/"}.get(scheme, f"{scheme}/") + rest)
        else:
            out.append("site/" + n)
    return out + scripts


def removals(build: dict) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for r in build.get("remove_after_install", []):
        out.setdefault(r["package"], []).extend(r["paths"])
    return out


def find_clashes(wheels: list[Wheel], cache: Path, build: dict) -> list[str]:
    """Files a later wheel would install where an earlier one already put one (after the removals)."""
    owner: dict[str, str] = {}
    remove = removals(build)
    clashes = []
    for w in wheels:
        for dest in wheel_destinations(cache / w.filename):
            if dest in owner and owner[dest] != w.name:
                clashes.append(f"{dest.removeprefix('site/')}: installed by {owner[dest]} and {w.name}")
            owner[dest] = w.name
        for rel in remove.get(w.name, []):
            owner.pop(f"site/{rel}", None)
    return clashes


def make_venv(prefix: Path, build: dict, python: str) -> Path:
    """runtime.nix's prefix layout: bin/python a link to the interpreter, pyvenv.cfg beside bin/."""
    (prefix / "bin").mkdir(parents=True, exist_ok=True)
    real = Path(python).resolve()
    (prefix / "bin" / "python").symlink_to(real)
    version = subprocess.run([str(real), "-c", "import platform; print(platform.python_version())"],
                             capture_output=True, text=True, check=True).stdout.strip()
    text = "\n".join(build["pyvenv_cfg"]) + "\n"
    text = text.replace("@pythonBin@", str(real.parent)).replace("@pythonVersion@", version)
    (prefix / "pyvenv.cfg").write_text(text)
    return prefix / "bin" / "python"


def apply_overlay(site: Path, line: Line, python: Path) -> tuple[list[str], str]:
    """runtime.nix's overlay step: nix/apply-overlay.py with the line's release and series, dspark's
    overlay applier on PYTHONPATH. Returns (problems, what it printed)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHOME"}
    env["PYTHONPATH"] = str(HERE.parent / "src")
    proc = subprocess.run([str(python), str(APPLY_OVERLAY), "--vllm-version", line.vllm, str(site),
                           *map(str, line.series)], env=env, capture_output=True, text=True, timeout=600)
    said = (proc.stdout + proc.stderr).strip()
    return ([] if proc.returncode == 0 else [s for s in said.splitlines() if s.strip()]), said


def site_packages(prefix: Path) -> Path:
    py = prefix / "bin" / "python"
    out = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         capture_output=True, text=True, check=True).stdout.strip()
    return Path(out)


def install(prefix: Path, wheels: list[Wheel], cache: Path, build: dict, installer: Path,
            python: str = sys.executable, log=print) -> list[str]:
    """Install like runtime.nix's installPhase; returns the failures (installer's own errors)."""
    py = make_venv(prefix, build, python)
    env = dict(os.environ, PYTHONPATH=str(installer))
    env.pop("PYTHONHOME", None)
    remove = removals(build)
    site = site_packages(prefix)
    failures = []
    for i, w in enumerate(wheels, 1):
        cmd = [str(py), "-m", "installer", *build["installer_flags"], "--prefix", str(prefix),
               str(cache / w.filename)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or ["exit status %d" % proc.returncode])[-1]
            failures.append(f"{w.filename}: {last}")
        for rel in remove.get(w.name, []):
            target = site / rel
            if not target.is_file():
                failures.append(f"runtime-build.json removes {rel} after {w.name}, which it does not install")
            else:
                target.unlink()
        if i % 25 == 0:
            log(f"  installed {i}/{len(wheels)}")
    return failures


# ---------------------------------------------------------------- ELF objects

@dataclass
class Elf:
    path: Path
    machine: int
    type: int
    needed: list[str] = field(default_factory=list)
    soname: str | None = None
    loads: list[tuple[int, int, int]] = field(default_factory=list)  # (p_offset, p_vaddr, p_align)
    # .note.dlopen (systemd's ELF dlopen metadata): each entry a list of alternative sonames.
    dlopen_notes: list[list[str]] = field(default_factory=list)


def read_elf(path: Path) -> Elf | None:
    """The header, PT_LOAD segments and dynamic section of an ELF file (None if not ELF)."""
    with path.open("rb") as f:
        ident = f.read(16)
        if len(ident) < 16 or ident[:4] != b"\x7fELF":
            return None
        is64, end = ident[4] == 2, "<" if ident[5] == 1 else ">"
        hdr = f.read(48 if is64 else 36)
        try:
            if is64:
                (etype, machine, _, _, phoff, shoff, _, _, phentsize, phnum, shentsize, shnum,
                 shstrndx) = struct.unpack(end + "HHIQQQIHHHHHH", hdr[:48])
            else:
                (etype, machine, _, _, phoff, shoff, _, _, phentsize, phnum, shentsize, shnum,
                 shstrndx) = struct.unpack(end + "HHIIIIIHHHHHH", hdr[:36])
            elf = Elf(path, machine, etype)
            elf.dlopen_notes = read_dlopen_notes(f, end, is64, shoff, shentsize, shnum, shstrndx)
            f.seek(phoff)
            phdrs = f.read(phentsize * phnum)
            dynamic = None
            segs = []
            for i in range(phnum):
                raw = phdrs[i * phentsize:(i + 1) * phentsize]
                if is64:
                    p_type, _, off, vaddr, _, filesz, _, align = struct.unpack(end + "IIQQQQQQ", raw[:56])
                else:
                    p_type, off, vaddr, _, filesz, _, _, align = struct.unpack(end + "IIIIIIII", raw[:32])
                segs.append((p_type, off, vaddr, filesz))
                if p_type == 1:
                    elf.loads.append((off, vaddr, align))
                elif p_type == 2:
                    dynamic = (off, filesz)
            if dynamic is None:
                return elf
            f.seek(dynamic[0])
            data = f.read(dynamic[1])
            size = 16 if is64 else 8
            entries = [struct.unpack(end + ("qQ" if is64 else "iI"), data[i:i + size])
                       for i in range(0, len(data) - size + 1, size)]
            strtab_vaddr = next((v for t, v in entries if t == 5), None)
            if strtab_vaddr is None:
                return elf
            # DT_STRTAB is an address: map it to a file offset through the segment holding it.
            strtab_off = next((off + strtab_vaddr - vaddr for t, off, vaddr, sz in segs
                               if t == 1 and vaddr <= strtab_vaddr < vaddr + sz), strtab_vaddr)

            def string(offset: int) -> str:
                f.seek(strtab_off + offset)
                buf = f.read(4096)
                return buf.split(b"\0", 1)[0].decode(errors="replace")

            for tag, val in entries:
                if tag == 0:
                    break
                if tag == 1:
                    elf.needed.append(string(val))
                elif tag == 14:
                    elf.soname = string(val)
            return elf
        except struct.error:
            return None


NT_FDO_DLOPEN = 0x407C0C0A


def read_dlopen_notes(f, end: str, is64: bool, shoff: int, shentsize: int, shnum: int,
                      shstrndx: int) -> list[list[str]]:
    """The sonames of a .note.dlopen section (owner "FDO", type 0x407c0c0a, a JSON array of
    {"soname": [...]}): autoPatchelf resolves these as it does DT_NEEDED."""
    if not shoff or not shnum or shstrndx >= shnum:
        return []
    f.seek(shoff)
    raw = f.read(shentsize * shnum)
    fmt, size = (end + "IIQQQQIIQQ", 64) if is64 else (end + "IIIIIIIIII", 40)
    if len(raw) < shentsize * shnum or shentsize < size:
        return []
    sections = [struct.unpack(fmt, raw[i * shentsize:i * shentsize + size]) for i in range(shnum)]
    names_off, names_size = sections[shstrndx][4], sections[shstrndx][5]
    f.seek(names_off)
    names = f.read(names_size)
    out: list[list[str]] = []
    for sec in sections:
        name = names[sec[0]:names.find(b"\0", sec[0])]
        if name != b".note.dlopen" or sec[1] != 7:  # SHT_NOTE
            continue
        f.seek(sec[4])
        data = f.read(sec[5])
        pos = 0
        while pos + 12 <= len(data):
            namesz, descsz, ntype = struct.unpack(end + "III", data[pos:pos + 12])
            pos += 12
            owner = data[pos:pos + namesz].rstrip(b"\0")
            pos += (namesz + 3) & ~3
            desc = data[pos:pos + descsz]
            pos += (descsz + 3) & ~3
            if owner == b"FDO" and ntype == NT_FDO_DLOPEN:
                try:
                    entries = json.loads(desc.rstrip(b"\0").decode())
                    out += [[str(n) for n in e["soname"]] for e in entries]
                except (ValueError, KeyError, TypeError):
                    continue
    return out


def elf_objects(prefix: Path) -> list[Elf]:
    out = []
    for root, _, files in os.walk(prefix):
        for name in files:
            p = Path(root) / name
            if p.is_symlink() or not p.is_file():
                continue
            elf = read_elf(p)
            if elf is not None:
                out.append(elf)
    return out


def provided_by_build(build: dict) -> dict[str, str]:
    """Library name -> what provides it, besides the prefix: the nixpkgs libraries and the driver."""
    out = {}
    for lib in build["host_libraries"]:
        for so in lib["sonames"]:
            out[so] = f"nixpkgs {lib['attr']}"
    for so in build["driver_libraries"]:
        out[so] = "the NVIDIA driver (host)"
    return out


def unresolved_needed(elves: list[Elf], prefix: Path, build: dict) -> list[str]:
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

# A library name as a string of its own in an object (a dlopen argument): "libibverbs.so.1".
SONAME_STRING = re.compile(rb"lib[A-Za-z0-9_+\-.]*?\.so(?:\.[0-9]+)*(?=\x00)")


def named_sonames(path: Path) -> set[str]:
    """The library names an object holds as whole strings: NUL-terminated, and preceded by a NUL
    or another byte that is not printable (a length prefix), so that a name inside a message
    ("Failed to open libgdrapi.so.2") is not taken for one. Not seen: a name built at run time
    ("libnvrtc.so.%d", "lib%s.so") or one the compiler stores inside instructions."""
    out = set()
    with path.open("rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return out
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            for match in SONAME_STRING.finditer(m):
                before = m[match.start() - 1] if match.start() > 0 else 0
                if before < 0x20 or before > 0x7E:
                    out.add(match.group().decode())
    return out


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


def build_runpaths(build: dict) -> list[str]:
    """What runtime.nix appends to every object's RPATH (appendRunpaths): the driver's directory,
    the lib/ of each host library marked append_runpath, and runtime-build.json's
    append_runpaths ("$ORIGIN": the object's own directory)."""
    return (["driver"] + [f"nixpkgs {lib['attr']}" for lib in build["host_libraries"] if lib.get("append_runpath")]
            + [entry["path"] for entry in build.get("append_runpaths", [])])


def check_runtime_loads(elves: list[Elf], prefix: Path, build: dict, machine: int = EM_AARCH64) -> LoadCheck:
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
            def on_runpath(so: str) -> str | None:
                hit = sorted(d for d in sure if so in in_dir.get(d, ()))
                if hit:
                    return hit[0]
                for cands in either:
                    if all(so in in_dir.get(d, ()) for d in cands):
                        return sorted(cands)[0]
                return None
            found = next(((so, d) for so in group if (d := on_runpath(so))), None)
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


def strip_breaks(elves: list[Elf], prefix: Path, build: dict, strip: str | None = None) -> list[str]:
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


# ---------------------------------------------------------------- the replay

@dataclass
class Report:
    wheels: int = 0
    elf_objects: int = 0
    line: str = ""
    overlay: str = ""
    clashes: list[str] = field(default_factory=list)
    install_errors: list[str] = field(default_factory=list)
    unresolved: list[str] = field(default_factory=list)
    pth_imports: list[str] = field(default_factory=list)
    load_failures: list[str] = field(default_factory=list)
    runtime_loads: LoadCheck = field(default_factory=LoadCheck)
    unresolved_loads: list[str] = field(default_factory=list)
    overlay_errors: list[str] = field(default_factory=list)

    SECTIONS = (("clashes", "file clashes"), ("install_errors", "installer errors"),
                ("unresolved", "unresolved DT_NEEDED"), ("pth_imports", "imports depending on .pth files"),
                ("load_failures", "objects glibc would refuse (stripping)"),
                ("unresolved_loads", "libraries loaded at run time that the build leaves unresolvable"),
                ("overlay_errors", "overlay series errors"))

    @property
    def ok(self) -> bool:
        return not any(getattr(self, k) for k, _ in self.SECTIONS)

    def text(self) -> str:
        lines = [f"replayed {self.wheels} wheels, {self.elf_objects} ELF objects (runtime line {self.line})",
                 self.runtime_loads.summary(), f"overlay: {self.overlay}"]
        for key, title in self.SECTIONS:
            items = getattr(self, key)
            lines.append(f"{title}: {len(items)}")
            lines += [f"  {i}" for i in items]
        lines.append("OK" if self.ok else "FAILED")
        return "\n".join(lines)


def replay(cache: Path, prefix: Path, offline: bool = False, python: str = sys.executable,
           line: Line | None = None, build_path: Path = BUILD, log=print) -> Report:
    line = line or load_line()
    wheels, build = load_plan(line.lock, build_path)
    inst = installer_wheel(build)
    fetch(cache, [*wheels, inst], offline, log)
    report = Report(wheels=len(wheels), line=line.id)
    report.clashes = find_clashes(wheels, cache, build)
    log(f"installing {len(wheels)} wheels into {prefix}")
    report.install_errors = install(prefix, wheels, cache, build, cache / inst.filename, python, log)
    elves = elf_objects(prefix)
    report.elf_objects = len(elves)
    report.unresolved = unresolved_needed(elves, prefix, build)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    report.pth_imports = pth_imports(site_packages(prefix), prefix / "bin" / "python", env)
    report.load_failures = strip_breaks(elves, prefix, build)
    report.runtime_loads = check_runtime_loads(elves, prefix, build)
    report.unresolved_loads = report.runtime_loads.unresolved
    # Last, as in runtime.nix's installPhase (the ELF checks above read no patched file).
    report.overlay_errors, report.overlay = apply_overlay(site_packages(prefix), line, prefix / "bin" / "python")
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--line", help="the runtime line to replay (default: the default line, as `nix build .#runtime`)")
    ap.add_argument("--cache", type=Path, default=DEFAULT_CACHE,
                    help=f"wheel cache directory (default {DEFAULT_CACHE})")
    ap.add_argument("--prefix", type=Path, help="install here and keep it (default: a temporary directory)")
    ap.add_argument("--offline", action="store_true", help="fail instead of fetching what is not cached")
    ap.add_argument("--json", type=Path, help="also write the report as JSON")
    args = ap.parse_args(argv)
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    try:
        line = load_line(args.line)
        if args.prefix is not None:
            if args.prefix.exists() and any(args.prefix.iterdir()):
                raise ReplayError(f"--prefix {args.prefix} is not empty")
            report = replay(args.cache, args.prefix, args.offline, line=line, log=log)
        else:
            with tempfile.TemporaryDirectory(prefix="dspark-replay-") as tmp:
                report = replay(args.cache, Path(tmp) / "runtime", args.offline, line=line, log=log)
    except ReplayError as e:
        print(f"replay-runtime: {e}", file=sys.stderr)
        return 2
    print(report.text())
    if args.json:
        data = {k: getattr(report, k) for k in ("wheels", "elf_objects", "line", "overlay",
                                                 *(k for k, _ in Report.SECTIONS))}
        loads = report.runtime_loads
        data["runtime_loads"] = {"objects": loads.objects, "checked": loads.checked,
                                 **{k: getattr(loads, k) for k in ("resolved", "glibc", "driver", "absent", "unresolved")}}
        args.json.write_text(json.dumps(dict(data, ok=report.ok), indent=1) + "\n")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
