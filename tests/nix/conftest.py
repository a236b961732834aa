"""Fixtures for the Nix tests: the Nix evaluator and nixpkgs.lib (never committed)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# Places the lib/ directory of nix-community/nixpkgs.lib is looked for, in order, unless
# $DSPARK_NIXPKGS_LIB is set: first shared/ beside the repository root (where CI's fresh clone
# sits too, shared/nixpkgs.lib/SOURCE says which release), then local checkouts.
NIXPKGS_LIB_CANDIDATES = [REPO.parent / "shared" / "nixpkgs.lib" / "lib",
                          Path("/tmp/nixpkgs.lib/lib"), Path("/opt/nixpkgs.lib/lib")]


@pytest.fixture(scope="session")
def nix_instantiate() -> str:
    path = shutil.which("nix-instantiate")
    if path is None:
        pytest.skip("Nix is not installed (nix-instantiate not on PATH); run .ci/setup-nix")
    return path


def _is_lib(path: Path) -> bool:
    return (path / "modules.nix").is_file() and (path / "default.nix").is_file()


def _release(path: Path) -> str:
    version = path / ".version"
    return version.read_text().strip() if version.is_file() else path.parent.name


def _libs() -> list[Path]:
    """$DSPARK_NIXPKGS_LIB: one lib/ directory, or several separated by ':' (two releases, say),
    each evaluated in turn; else the first local candidate found."""
    env = os.environ.get("DSPARK_NIXPKGS_LIB")
    if env:
        return [Path(p) for p in env.split(os.pathsep) if p]
    return [p for p in NIXPKGS_LIB_CANDIDATES if _is_lib(p)][:1]


LIBS = _libs()


@pytest.fixture(scope="session", params=LIBS or [None],
                ids=lambda p: f"lib-{_release(p)}" if p is not None and _is_lib(p) else "no-lib")
def nixpkgs_lib(request) -> Path:
    path = request.param
    if path is not None and _is_lib(path):
        return path
    looked = [path] if path is not None else NIXPKGS_LIB_CANDIDATES
    pytest.skip(
        "nixpkgs.lib not found (looked at "
        + ", ".join(str(p) for p in looked)
        + "): it cannot be committed; set DSPARK_NIXPKGS_LIB to the lib/ directory of a "
        "nix-community/nixpkgs.lib checkout (several separated by ':') to evaluate the NixOS module"
    )


def pytest_report_header(config):
    """Which nixpkgs.lib the module evaluations run against (their releases, from lib/.version)."""
    found = [f"{p} (release {_release(p)})" for p in LIBS if _is_lib(p)]
    return "nixpkgs.lib: " + ", ".join(found) if found else None


@pytest.fixture
def evaluate(nix_instantiate, nixpkgs_lib):
    """Evaluates the NixOS module for a host (Nix text) through tests/nix/eval.nix: its config as JSON."""
    from tests.nix.nix_support import nix_eval

    def run(host_nix: str) -> dict:
        return nix_eval(nix_instantiate,
                        f"import ./tests/nix/eval.nix {{ libPath = {nixpkgs_lib}; host = {host_nix}; }}")
    return run


@pytest.fixture(scope="module")
def stub(nix_instantiate, nixpkgs_lib, tmp_path_factory) -> Path:
    """A stand-in nixpkgs (stub-nixpkgs/default.nix) over the real nixpkgs.lib, for evaluating the
    flake's packages without nixpkgs' package set."""
    import json

    d = tmp_path_factory.mktemp("stub-nixpkgs")
    shutil.copy(Path(__file__).with_name("stub-nixpkgs") / "default.nix", d / "default.nix")
    (d / "lib-path.nix").write_text(json.dumps(str(nixpkgs_lib)) + "\n")
    return d
