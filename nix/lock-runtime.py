#!/usr/bin/env python3
"""Regenerate nix/runtime-lock.json, the hash-pinned GB10 runtime, from nix/runtime-requirements.txt.

    python3 -m venv /tmp/lockenv && /tmp/lockenv/bin/pip install uv packaging
    /tmp/lockenv/bin/python nix/lock-runtime.py          # writes nix/runtime-lock.json

Steps:
1. `uv pip compile` resolves the requirements for the nodes (CPython 3.12, aarch64, glibc 2.39:
   the DGX OS release the GB10 nodes run), wheels only, as a PEP 751 pylock.
2. For every package, the wheel that CPython 3.12 on manylinux_2_39_aarch64 would prefer is kept
   (name, version, filename, sha256). The index's URLs are used to read metadata and are never
   written: Nix's fetchers know where PyPI artifacts live.
3. Each kept wheel's own core metadata (PEP 658 `.metadata`, else the wheel's METADATA) gives its
   Requires-Dist, recorded verbatim so tests can check that the lock is closed under its
   requirements without asking the index again.
4. The packages in EXCLUDED are left out (with what only they need), and recorded in the lock's
   "excluded" with the reason: `--exclusions-only` applies this step to the existing lock.
5. The packages in OVERRIDES are pinned by their root requirement in runtime-requirements.txt in
   place of what other packages require of them (uv's `--override`; the Nix build installs wheels
   without a resolver), and recorded in the lock's "overrides" with the reason. `--repin WHEEL`
   puts one downloaded wheel of an overridden package into the existing lock: its sha256 computed
   from the file, its Requires-Dist read from the file, nothing else re-resolved.
"""

from __future__ import annotations

import argparse
import email.parser
import hashlib
import io
import json
import shutil
import subprocess
import sys
import tempfile
import tomllib
import urllib.request
import zipfile
from pathlib import Path

from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.tags import Tag, compatible_tags, cpython_tags
from packaging.utils import canonicalize_name, parse_wheel_filename

HERE = Path(__file__).resolve().parent
PYTHON = (3, 12)
GLIBC_MINOR = 39  # glibc 2.39: Ubuntu 24.04, the base of the nodes' DGX OS
ARCH = "aarch64"
UV_PLATFORM = f"{ARCH}-manylinux_2_{GLIBC_MINOR}"

# The environment markers of the target interpreter (PEP 508). The patch level is unknown until
# nixpkgs' python312 is built; no locked requirement depends on it.
TARGET_ENV = {
    "implementation_name": "cpython",
    "implementation_version": "3.12.0",
    "os_name": "posix",
    "platform_machine": ARCH,
    "platform_python_implementation": "CPython",
    "platform_system": "Linux",
    "python_full_version": "3.12.0",
    "python_version": "3.12",
    "sys_platform": "linux",
}


# Requirements of vLLM that serving text does not need and that the runtime leaves out. Each is
# shown not to be needed by the CPU venv that the tests serve from (tests/nix/test_exclusions.py:
# the venv lacks them, vLLM imports and the local pair serves); the reason is recorded in the lock.
EXCLUDED = {
    "torchcodec": "video and audio decoding for multimodal inputs; links FFmpeg 4-9 and libheif, "
                  "which nothing in the runtime provides (35 unresolved libraries for autoPatchelf)",
}


# Pins that replace what another locked package requires. Each is a root in
# runtime-requirements.txt; every other requirement on that name is overridden by it (and the
# lock's tests check the locked version against the root instead). The reason is recorded in the
# lock; the evidence is in runtime-requirements.txt and overlay/README.md ("Known GB10 failures").
OVERRIDES = {
    "flashinfer-python": "vLLM 0.28.0 pins 0.6.16.post3, which lacks the fix for the GB10-only "
                         "SM120 sparse-MLA prefill deadlock (flashinfer #3700, fixed by #4732, first "
                         "released in 0.6.18); vLLM 0.28.0's calls bind to 0.6.18 (tests/overlay)",
}


def target_tags() -> list[Tag]:
    """Wheel tags CPython 3.12 accepts on manylinux_2_39 aarch64, most preferred first."""
    platforms = [f"manylinux_2_{m}_{ARCH}" for m in range(GLIBC_MINOR, 16, -1)]
    platforms += [f"manylinux2014_{ARCH}", f"linux_{ARCH}"]
    interp = f"cp{PYTHON[0]}{PYTHON[1]}"
    return list(cpython_tags(PYTHON, [interp, "abi3", "none"], platforms)) + list(
        compatible_tags(PYTHON, interp, platforms))


def pick_wheel(wheels: list[dict], ranking: dict[Tag, int]) -> dict:
    best, best_rank = None, None
    for wheel in wheels:
        filename = wheel.get("name") or wheel["url"].rsplit("/", 1)[1]
        _, _, _, tags = parse_wheel_filename(filename)
        ranks = [ranking[t] for t in tags if t in ranking]
        if ranks and (best_rank is None or min(ranks) < best_rank):
            best, best_rank = dict(wheel, filename=filename), min(ranks)
    if best is None:
        names = ", ".join(w.get("name") or w["url"].rsplit("/", 1)[1] for w in wheels)
        raise SystemExit(f"no wheel for cp312 / manylinux_2_{GLIBC_MINOR}_{ARCH} among: {names}")
    return best


def read_metadata(url: str) -> str:
    """Core metadata of a wheel: the index's PEP 658 file, else the wheel's own METADATA."""
    try:
        with urllib.request.urlopen(url + ".metadata", timeout=120) as r:
            return r.read().decode()
    except OSError:
        pass
    with urllib.request.urlopen(url, timeout=600) as r:
        data = r.read()
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
        return z.read(name).decode()


def override_lines(roots: list[str], overrides: dict[str, str] = OVERRIDES) -> list[str]:
    """The root requirements that override every other requirement on their package."""
    lines = [r for r in roots if canonicalize_name(Requirement(r).name) in overrides]
    missing = set(overrides) - {canonicalize_name(Requirement(r).name) for r in lines}
    if missing:
        raise SystemExit(f"OVERRIDES names {sorted(missing)}, which runtime-requirements.txt does not pin")
    return lines


def compile_pylock(requirements: Path, uv: str, workdir: Path) -> dict:
    out = workdir / "pylock.toml"
    cmd = [uv, "pip", "compile", str(requirements), "--python-version", f"{PYTHON[0]}.{PYTHON[1]}",
           "--python-platform", UV_PLATFORM, "--only-binary", ":all:", "--format", "pylock.toml",
           "--no-header", "--quiet", "-o", str(out)]
    overrides = override_lines(read_requirements(requirements))
    if overrides:
        (workdir / "overrides.txt").write_text("\n".join(overrides) + "\n")
        cmd += ["--override", str(workdir / "overrides.txt")]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return tomllib.loads(out.read_text())


def build_lock(pylock: dict, roots: list[str]) -> dict:
    ranking = {tag: i for i, tag in enumerate(target_tags())}
    packages = []
    for pkg in pylock["packages"]:
        if "marker" in pkg and not Marker(pkg["marker"]).evaluate(TARGET_ENV):
            continue
        wheel = pick_wheel(pkg.get("wheels", []), ranking)
        meta = email.parser.Parser().parsestr(read_metadata(wheel["url"]), headersonly=True)
        name = canonicalize_name(pkg["name"])
        if canonicalize_name(meta["Name"]) != name or meta["Version"] != pkg["version"]:
            raise SystemExit(f"{wheel['filename']}: metadata says {meta['Name']} {meta['Version']}")
        packages.append({
            "name": name,
            "version": pkg["version"],
            "filename": wheel["filename"],
            "sha256": wheel["hashes"]["sha256"],
            "requires_dist": meta.get_all("Requires-Dist") or [],
        })
        print(f"  {name} {pkg['version']}", file=sys.stderr)
    return apply_exclusions({
        "comment": "Generated by nix/lock-runtime.py from nix/runtime-requirements.txt; do not edit.",
        "overrides": dict(sorted(OVERRIDES.items())),
        "python": f"{PYTHON[0]}.{PYTHON[1]}",
        "platform": f"manylinux_2_{GLIBC_MINOR}_{ARCH}",
        "environment": TARGET_ENV,
        "requirements": roots,
        "packages": sorted(packages, key=lambda p: p["name"]),
    })


def apply_exclusions(lock: dict, excluded: dict[str, str] = EXCLUDED) -> dict:
    """The lock without the excluded packages and without what only they required."""
    env = lock["environment"]
    by_name = {p["name"]: p for p in lock["packages"]}
    reached: set[str] = set()
    todo = [Requirement(r) for r in lock["requirements"]]
    seen: set[tuple[str, str]] = set()
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        if name in excluded or name not in by_name:
            continue
        reached.add(name)
        for extra in ["", *sorted(req.extras)]:
            if (name, extra) in seen:
                continue
            seen.add((name, extra))
            for line in by_name[name]["requires_dist"]:
                dep = Requirement(line)
                applies = extra == "" if dep.marker is None else dep.marker.evaluate(dict(env, extra=extra))
                if applies:
                    todo.append(dep)
    return dict(lock, packages=[p for p in lock["packages"] if p["name"] in reached],
                excluded=dict(sorted(excluded.items())))


def repin(lock: dict, wheel: Path, roots: list[str]) -> dict:
    """The lock with the entry of `wheel`'s package replaced by that file: name, version and tags
    from its file name, sha256 computed from its bytes, Requires-Dist from its own METADATA. Only
    a package in OVERRIDES, at the version its root pins, for the nodes' platform."""
    name, version, _, tags = parse_wheel_filename(wheel.name)
    name = canonicalize_name(name)
    if name not in OVERRIDES:
        raise SystemExit(f"{wheel.name}: --repin takes a package of OVERRIDES ({', '.join(OVERRIDES)})")
    root = next(Requirement(r) for r in override_lines(roots) if canonicalize_name(Requirement(r).name) == name)
    if not root.specifier.contains(version, prereleases=True):
        raise SystemExit(f"{wheel.name}: runtime-requirements.txt pins {root}")
    if not tags & set(target_tags()):
        raise SystemExit(f"{wheel.name}: not installable on cp312 / manylinux_2_{GLIBC_MINOR}_{ARCH}")
    data = wheel.read_bytes()
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        member = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
        meta = email.parser.Parser().parsestr(z.read(member).decode(), headersonly=True)
    if canonicalize_name(meta["Name"]) != name or meta["Version"] != str(version):
        raise SystemExit(f"{wheel.name}: metadata says {meta['Name']} {meta['Version']}")
    entry = {"name": name, "version": str(version), "filename": wheel.name,
             "sha256": hashlib.sha256(data).hexdigest(), "requires_dist": meta.get_all("Requires-Dist") or []}
    packages = [entry if p["name"] == name else p for p in lock["packages"]]
    return dict(lock, requirements=roots, overrides=dict(sorted(OVERRIDES.items())), packages=packages)


def read_requirements(path: Path) -> list[str]:
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return [line for line in lines if line]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requirements", type=Path, default=HERE / "runtime-requirements.txt")
    ap.add_argument("--out", type=Path, default=HERE / "runtime-lock.json")
    ap.add_argument("--uv", default=shutil.which("uv") or str(Path(sys.executable).parent / "uv"))
    ap.add_argument("--exclusions-only", action="store_true",
                    help="only apply EXCLUDED to the existing lock (no resolution, no index)")
    ap.add_argument("--repin", type=Path, action="append", default=[], metavar="WHEEL",
                    help="put this downloaded wheel of a package in OVERRIDES into the existing lock "
                         "(sha256 computed from the file; no resolution, no index)")
    args = ap.parse_args(argv)
    if args.repin:
        lock = json.loads(args.out.read_text())
        for wheel in args.repin:
            lock = repin(lock, wheel, read_requirements(args.requirements))
        lock = apply_exclusions(lock)
        args.out.write_text(json.dumps(lock, indent=1) + "\n")
        print(f"{args.out}: {len(lock['packages'])} packages", file=sys.stderr)
        return 0
    if args.exclusions_only:
        lock = apply_exclusions(json.loads(args.out.read_text()))
        args.out.write_text(json.dumps(lock, indent=1) + "\n")
        print(f"{args.out}: {len(lock['packages'])} packages", file=sys.stderr)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        pylock = compile_pylock(args.requirements, args.uv, Path(tmp))
    lock = build_lock(pylock, read_requirements(args.requirements))
    args.out.write_text(json.dumps(lock, indent=1) + "\n")
    print(f"{args.out}: {len(lock['packages'])} packages", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
