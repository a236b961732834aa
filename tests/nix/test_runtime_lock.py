"""nix/runtime-lock.json: complete, consistent, hash-pinned, for the nodes' platform."""

from __future__ import annotations

import json
import re

import pytest
from packaging.requirements import Requirement
from packaging.tags import compatible_tags, cpython_tags
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

from tests.nix.nix_support import REPO, load_script, nix_eval

pytestmark = pytest.mark.nix

LOCK = json.loads((REPO / "nix/runtime-lock.json").read_text())
PACKAGES = {p["name"]: p for p in LOCK["packages"]}
ROOTS = {canonicalize_name(Requirement(r).name): Requirement(r) for r in LOCK["requirements"]}


def lock_runtime():
    return load_script("lock_runtime", "nix/lock-runtime.py")


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
        # An overridden package answers to its root requirement, whoever else requires it
        # (nix/lock-runtime.py OVERRIDES, uv's --override).
        wanted = ROOTS[name] if name in LOCK.get("overrides", {}) else req
        if not wanted.specifier.contains(pkg["version"], prereleases=True):
            faults.append(f"{wanted_by} requires {wanted}, but {name} {pkg['version']} is locked")
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
    overlay_pin = re.search(r'SUPPORTED_VLLM_VERSION = "([^"]+)"', (REPO / "src/dspark/lines/overlay.py").read_text())
    assert PACKAGES["vllm"]["version"] == "0.28.0" == overlay_pin.group(1)
    # The aarch64 wheel of vLLM 0.28.0 as published (shared/reference/runtime-pins.md).
    assert PACKAGES["vllm"]["sha256"] == "817b8181f7f61b4a62dc1d5d9ab39f2bfb60a6cb86c29879a78a147b85756787"
    assert PACKAGES["torch"]["version"] == "2.13.0"
    assert PACKAGES["b12x"]["version"] == "1.2.6"
    # torch 2.13.0's own exact pin; 2.29.3 and later carry NCCL's fix of the aarch64 proxy-op hang
    # that wedged 2.28.9 on GB10 (overlay/README.md, "Known GB10 failures").
    assert PACKAGES["nvidia-nccl-cu13"]["version"] == "2.29.7"
    assert 'nvidia-nccl-cu13==2.29.7; platform_system == "Linux"' in PACKAGES["torch"]["requires_dist"]


def test_flashinfer_carries_the_gb10_prefill_deadlock_fix():
    """0.6.18, the first release with flashinfer #4732 (the fix of #3700), over vLLM 0.28.0's exact
    pin of 0.6.16.post3; the wheel's sha256 as computed from the downloaded file."""
    fi = PACKAGES["flashinfer-python"]
    assert (fi["version"], fi["filename"]) == ("0.6.18", "flashinfer_python-0.6.18-py3-none-any.whl")
    assert fi["sha256"] == "d5d26edb48f8def0bf28b2c94415aef7f0754e2cd9e3cb3d6e7081262d068aad"
    assert "flashinfer-python==0.6.16.post3" in PACKAGES["vllm"]["requires_dist"]
    assert set(LOCK["overrides"]) == {"flashinfer-python"}


def test_overrides_are_roots_recorded_with_their_reason():
    """Every override is a pin of runtime-requirements.txt, recorded in the lock as the generator
    has it, and overrides a requirement some locked package really makes (a decision)."""
    mod = lock_runtime()
    assert LOCK["overrides"] == dict(sorted(mod.OVERRIDES.items()))
    for name in LOCK["overrides"]:
        assert ROOTS[name].specifier.contains(PACKAGES[name]["version"])
        others = [Requirement(r) for p in LOCK["packages"] for r in p["requires_dist"]
                  if canonicalize_name(Requirement(r).name) == name]
        assert any(not r.specifier.contains(PACKAGES[name]["version"]) for r in others), name


def test_repin_takes_the_hash_and_requirements_from_the_wheel(tmp_path):
    """--repin writes what the file says: its sha256, its own Requires-Dist; and refuses a wheel of a
    package that is not overridden or of another version than the root pins."""
    import hashlib
    import zipfile
    mod = lock_runtime()
    wheel = tmp_path / "flashinfer_python-0.6.18-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("flashinfer_python-0.6.18.dist-info/METADATA",
                   "Metadata-Version: 2.1\nName: flashinfer-python\nVersion: 0.6.18\nRequires-Dist: numpy\n")
    lock = mod.repin(LOCK, wheel, LOCK["requirements"])
    entry = next(p for p in lock["packages"] if p["name"] == "flashinfer-python")
    assert entry["sha256"] == hashlib.sha256(wheel.read_bytes()).hexdigest()
    assert entry["requires_dist"] == ["numpy"]
    other = tmp_path / "flashinfer_python-0.6.17-py3-none-any.whl"
    other.write_bytes(wheel.read_bytes())
    with pytest.raises(SystemExit, match="pins flashinfer-python==0.6.18"):
        mod.repin(LOCK, other, LOCK["requirements"])
    with pytest.raises(SystemExit, match="OVERRIDES"):
        mod.repin(LOCK, tmp_path / "b12x-1.2.6-py3-none-any.whl", LOCK["requirements"])


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
    mod = lock_runtime()
    assert LOCK["excluded"] == mod.EXCLUDED and "torchcodec" in mod.EXCLUDED
    assert not set(mod.EXCLUDED) & set(PACKAGES)
    assert mod.apply_exclusions(LOCK) == LOCK
    # vLLM does require it: the exclusion is a decision, not an accident of resolution.
    assert any(r.startswith("torchcodec") for r in PACKAGES["vllm"]["requires_dist"])
