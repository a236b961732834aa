"""The dspark package's check phase (nix/package.nix: pytestCheckHook on nix/package-tests.json),
replayed without nixpkgs: the source the package's fileset takes, the package installed
(not editable) into a fresh virtual environment holding only its declared dependencies (no
vLLM), then pytest on the same paths, markers and disabled tests, in a network namespace of
its own (loopback only, as in the Nix sandbox) with HOME unset. What Nix's own pytest and
interpreter versions would change is not replayed."""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import shutil
import subprocess
import sys
import tempfile
import tomllib

import pytest
from packaging.requirements import Requirement

from tests.nix.nix_support import REPO

pytestmark = pytest.mark.nix  # a replay of the Nix build's check phase (no Nix needed)

DATA = json.loads((REPO / "nix/package-tests.json").read_text())
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def test_the_data_names_existing_tests_and_the_package_reads_it():
    for rel in DATA["source"] + DATA["paths"]:
        assert (REPO / rel).exists(), rel
    text = (REPO / "nix/package.nix").read_text()
    for needle in ("lib.importJSON ./package-tests.json", "tests.source", "tests.paths", "tests.markers",
                   "tests.disabled", "pytestCheckHook"):
        assert needle in text, needle


def _netns_available() -> bool:
    if shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "-n", "true"], capture_output=True, timeout=30).returncode == 0


def _pinned(requirement: str) -> str:
    """A declared dependency at the version the test venv has (no resolution of its own)."""
    name = Requirement(requirement).name
    return f"{name}=={md.version(name)}"


def test_the_check_phase_passes_on_the_installed_package_without_vllm(tmp_path):
    if not _netns_available():
        pytest.skip("unshare -n is not allowed here (needs root or user namespaces): no sandbox-like network")
    src = tmp_path / "source"
    src.mkdir()
    for rel in DATA["source"]:
        p = REPO / rel
        if p.is_dir():
            shutil.copytree(p, src / rel, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            shutil.copy2(p, src / rel)
    venv = tmp_path / "venv"
    # Nothing of this checkout's environment leaks in (PYTHONPATH, the venv's scripts).
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300, env=clean)
    py = str(venv / "bin" / "python")
    deps = [_pinned(r) for r in PYPROJECT["project"]["dependencies"]] + [f"pytest=={md.version('pytest')}"]
    pip = subprocess.run([py, "-m", "pip", "install", "-q", "--progress-bar", "off", *deps],
                         capture_output=True, text=True, timeout=600, env=clean)
    assert pip.returncode == 0, pip.stderr[-3000:]
    pip = subprocess.run([py, "-m", "pip", "install", "-q", "--progress-bar", "off", "--no-deps", str(src)],
                         capture_output=True, text=True, timeout=600, env=clean)
    assert pip.returncode == 0, pip.stderr[-3000:]
    probe = subprocess.run([py, "-c", "import importlib.util as u, dspark; print(dspark.__file__); "
                                      "print(u.find_spec('vllm') is None)"],
                           capture_output=True, text=True, timeout=60, cwd=src, env=clean)
    where, no_vllm = probe.stdout.split()
    assert str(venv) in where and no_vllm == "True", probe.stdout  # the installed copy, and no vLLM
    # As pytestCheckHook: the flags, then `-k "not (a or b)"` for disabledTests.
    args = [*DATA["paths"], "-p", "no:cacheprovider", "-m", DATA["markers"],
            "-k", "not (" + " or ".join(DATA["disabled"]) + ")"]
    # The sandbox's TMPDIR is short (/build): the tests' notify sockets must fit AF_UNIX's 108 bytes.
    tmp = tempfile.mkdtemp(prefix="dspark-pkg-", dir="/tmp")
    env = {"PATH": f"{venv}/bin:/usr/bin:/bin", "HOME": "/homeless-shelter", "TMPDIR": tmp, "LANG": "C.UTF-8"}
    try:
        run = subprocess.run(["unshare", "-n", "sh", "-c", 'ip link set lo up 2>/dev/null || true; exec "$@"',
                              "sh", py, "-m", "pytest", "-q", *args],
                             capture_output=True, text=True, timeout=1200, cwd=src, env=env)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    tail = run.stdout[-3000:] + run.stderr[-2000:]
    assert run.returncode == 0, tail
    assert " passed" in run.stdout and " failed" not in run.stdout, tail


def test_the_package_passes_the_replayed_flags_as_pytest_flags(nix_instantiate, nixpkgs_lib, tmp_path):
    """nix/package.nix evaluated with the stand-in nixpkgs (buildPythonApplication keeps its
    arguments): pytestFlags, not pytestFlagsArray (an error in nixpkgs 26.05), as structured
    attributes, so that each element (the marker expression with its spaces) is one argument,
    exactly the arguments the replay above runs."""
    from tests.nix.nix_support import nix_eval

    stub = tmp_path / "stub-nixpkgs"
    stub.mkdir()
    shutil.copy(REPO / "tests/nix/stub-nixpkgs/default.nix", stub / "default.nix")
    (stub / "lib-path.nix").write_text(json.dumps(str(nixpkgs_lib)) + "\n")
    drv = nix_eval(nix_instantiate, f"""
      let pkg = (import {stub} {{ }}).callPackage ./nix/package.nix {{ }};
      in {{
        array = pkg ? pytestFlagsArray;
        flags = pkg.pytestFlags or null;
        structured = pkg.__structuredAttrs or false;
        disabled = pkg.disabledTests;
        name = pkg.name;
      }}""")
    assert drv["array"] is False
    assert drv["flags"] == [*DATA["paths"], "-p", "no:cacheprovider", "-m", DATA["markers"]]
    assert " " in DATA["markers"] and drv["structured"] is True  # one argument, not split on blanks
    assert drv["disabled"] == DATA["disabled"]
    assert drv["name"] == f"dspark-{PYPROJECT['project']['version']}"
