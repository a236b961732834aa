"""nix/runtime-lock.json: complete, consistent, hash-pinned, for the nodes' platform."""

from __future__ import annotations

import json
import re

import pytest
from packaging.requirements import Requirement
from packaging.tags import compatible_tags, cpython_tags
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

from nix_support import REPO, nix_eval

pytestmark = pytest.mark.nix

LOCK = json.loads((REPO / "nix/runtime-lock.json").read_text())
PACKAGES = {p["name"]: p for p in LOCK["packages"]}


def applies(req: Requirement, extra: str) -> bool:
    if req.marker is None:
        return extra == ""
    return req.marker.evaluate(dict(LOCK["environment"], extra=extra))


def closure() -> tuple[set[str], list[str]]:
    """Walk the requirements from the roots, with extras; return the names reached and the faults."""
    reached: set[str] = set()
    faults: list[str] = []
    done: set[tuple[str, str]] = set()
    todo = [(Requirement(r), "requirements") for r in LOCK["requirements"]]
    while todo:
        req, wanted_by = todo.pop()
        name = canonicalize_name(req.name)
        if name in LOCK.get("excluded", {}):
            continue  # left out on purpose by nix/lock-runtime.py (EXCLUDED), with its reason
        pkg = PACKAGES.get(name)
        if pkg is None:
            faults.append(f"{wanted_by} requires {req}, which is not locked")
            continue
        if not req.specifier.contains(pkg["version"], prereleases=True):
            faults.append(f"{wanted_by} requires {req}, but {name} {pkg['version']} is locked")
        reached.add(name)
        for extra in ["", *sorted(req.extras)]:
            if (name, extra) in done:
                continue
            done.add((name, extra))
            for line in pkg["requires_dist"]:
                dep = Requirement(line)
                if applies(dep, extra):
                    todo.append((dep, f"{name}{'[' + extra + ']' if extra else ''}"))
    return reached, faults


def test_every_requirement_of_every_locked_package_is_locked():
    reached, faults = closure()
    assert faults == []
    # ...and nothing is locked that the roots do not need.
    assert sorted(set(PACKAGES) - reached) == []


def test_one_version_per_name():
    names = [p["name"] for p in LOCK["packages"]]
    assert len(names) == len(set(names))
    assert all(canonicalize_name(n) == n for n in names)


def test_every_entry_is_a_well_formed_pin():
    for p in LOCK["packages"]:
        assert set(p) == {"name", "version", "filename", "sha256", "requires_dist"}, p["name"]
        assert re.fullmatch(r"[0-9a-f]{64}", p["sha256"]), p["name"]
        name, version, build, _ = parse_wheel_filename(p["filename"])
        assert (name, version, build) == (p["name"], Version(p["version"]), ()), p["filename"]


def test_wheels_fit_the_nodes():
    """Every wheel installs on CPython 3.12, aarch64, glibc 2.39."""
    assert (LOCK["python"], LOCK["platform"]) == ("3.12", "manylinux_2_39_aarch64")
    platforms = [f"manylinux_2_{m}_aarch64" for m in range(39, 16, -1)]
    platforms += ["manylinux2014_aarch64", "linux_aarch64"]
    accepted = set(cpython_tags((3, 12), ["cp312", "abi3", "none"], platforms))
    accepted |= set(compatible_tags((3, 12), "cp312", platforms))
    for p in LOCK["packages"]:
        assert parse_wheel_filename(p["filename"])[3] & accepted, p["filename"]


def test_pins_the_release_the_overlay_is_written_for():
    overlay_pin = re.search(r'SUPPORTED_VLLM_VERSION = "([^"]+)"', (REPO / "src/dspark/overlay.py").read_text())
    assert PACKAGES["vllm"]["version"] == "0.28.0" == overlay_pin.group(1)
    # The aarch64 wheel of vLLM 0.28.0 as published (shared/reference/runtime-pins.md).
    assert PACKAGES["vllm"]["sha256"] == "817b8181f7f61b4a62dc1d5d9ab39f2bfb60a6cb86c29879a78a147b85756787"
    assert PACKAGES["torch"]["version"] == "2.13.0"
    assert PACKAGES["flashinfer-python"]["version"] == "0.6.16.post3"
    assert PACKAGES["b12x"]["version"] == "1.2.6"


def test_the_roots_are_the_requirements_file():
    lines = (REPO / "nix/runtime-requirements.txt").read_text().splitlines()
    roots = [line.split("#", 1)[0].strip() for line in lines]
    assert LOCK["requirements"] == [r for r in roots if r]


def test_no_urls_in_the_lock_or_the_nix_files():
    for path in [REPO / "nix/runtime-lock.json", *sorted((REPO / "nix").glob("*.nix"))]:
        assert "://" not in path.read_text(), path


def test_fetch_arguments_rebuild_every_locked_file_name(nix_instantiate):
    """fetchPypi rebuilds the file name from these parts; each must give back the locked name."""
    expr = """
      let lock = builtins.fromJSON (builtins.readFile ./nix/runtime-lock.json);
      in map (p: let a = import ./nix/wheel-source.nix p; in {
        file = "${a.pname}-${a.version}-${a.python}-${a.abi}-${a.platform}.whl";
        inherit (a) format dist python sha256;
      }) lock.packages"""
    out = nix_eval(nix_instantiate, expr)
    assert [o["file"] for o in out] == [p["filename"] for p in LOCK["packages"]]
    assert [o["sha256"] for o in out] == [p["sha256"] for p in LOCK["packages"]]
    assert all(o["format"] == "wheel" and o["dist"] == o["python"] for o in out)


def test_exclusions_are_applied_and_recorded():
    """What nix/lock-runtime.py leaves out is out of the lock, with its reason, and re-applying
    the exclusions to the lock changes nothing (the lock is what the generator writes)."""
    import importlib.util
    import sys
    spec = importlib.util.spec_from_file_location("lock_runtime", REPO / "nix/lock-runtime.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["lock_runtime"] = mod
    spec.loader.exec_module(mod)
    assert LOCK["excluded"] == mod.EXCLUDED and "torchcodec" in mod.EXCLUDED
    assert not set(mod.EXCLUDED) & set(PACKAGES)
    assert mod.apply_exclusions(LOCK) == LOCK
    # vLLM does require it: the exclusion is a decision, not an accident of resolution.
    assert any(r.startswith("torchcodec") for r in PACKAGES["vllm"]["requires_dist"])
