"""The wheels: fetched into the cache by name, version and sha256, then installed into the
prefix and patched by the line's overlay series, as nix/runtime.nix's installPhase does."""

from __future__ import annotations

import configparser
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import Any

from .plan import APPLY_OVERLAY, REPO, Line, ReplayError, Wheel

Log = Callable[[str], object]  # where progress goes (a line at a time)


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def pip_platform_args(lock: dict[str, Any] | None = None) -> list[str]:
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


def fetch(cache: Path, wheels: list[Wheel], offline: bool, log: Log = print) -> None:
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

class CaseConfigParser(configparser.ConfigParser):
    """entry_points.txt as installer reads it: option names (the scripts' names) kept as written."""

    def optionxform(self, optionstr: str) -> str:
        return optionstr


def wheel_destinations(path: Path) -> list[str]:
    """Where installer puts a wheel's files, relative to the prefix ('site/...' for site-packages)."""
    with zipfile.ZipFile(path) as z:
        names = [n for n in z.namelist() if not n.endswith("/")]
        entry_points = next((n for n in names if n.endswith(".dist-info/entry_points.txt")
                             and n.count("/") == 1), None)
        scripts: list[str] = []
        if entry_points:
            cp = CaseConfigParser(delimiters=("=",), interpolation=None)
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


def removals(build: dict[str, Any]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for r in build.get("remove_after_install", []):
        out.setdefault(r["package"], []).extend(r["paths"])
    return out


def find_clashes(wheels: list[Wheel], cache: Path, build: dict[str, Any]) -> list[str]:
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


def make_venv(prefix: Path, build: dict[str, Any], python: str) -> Path:
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
    env["PYTHONPATH"] = str(REPO / "src")
    proc = subprocess.run([str(python), str(APPLY_OVERLAY), "--vllm-version", line.vllm, str(site),
                           *map(str, line.series)], env=env, capture_output=True, text=True, timeout=600)
    said = (proc.stdout + proc.stderr).strip()
    return ([] if proc.returncode == 0 else [s for s in said.splitlines() if s.strip()]), said


def site_packages(prefix: Path) -> Path:
    py = prefix / "bin" / "python"
    out = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         capture_output=True, text=True, check=True).stdout.strip()
    return Path(out)


def install(prefix: Path, wheels: list[Wheel], cache: Path, build: dict[str, Any], installer: Path,
            python: str = sys.executable, log: Log = print) -> list[str]:
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
            last = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
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

