"""Fixtures for the Nix tests: the Nix evaluator and nixpkgs.lib (never committed)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

# Local places a checkout of nix-community/nixpkgs.lib is looked for, after $DSPARK_NIXPKGS_LIB.
NIXPKGS_LIB_CANDIDATES = [Path("/tmp/nixpkgs.lib/lib"), Path("/opt/nixpkgs.lib/lib")]


@pytest.fixture(scope="session")
def nix_instantiate() -> str:
    path = shutil.which("nix-instantiate")
    if path is None:
        pytest.skip("Nix is not installed (nix-instantiate not on PATH); run .ci/setup-nix")
    return path


@pytest.fixture(scope="session")
def nixpkgs_lib() -> Path:
    env = os.environ.get("DSPARK_NIXPKGS_LIB")
    candidates = [Path(env)] if env else NIXPKGS_LIB_CANDIDATES
    for path in candidates:
        if (path / "modules.nix").is_file() and (path / "default.nix").is_file():
            return path
    pytest.skip(
        "nixpkgs.lib not found (looked at "
        + ", ".join(str(p) for p in candidates)
        + "): it cannot be committed; set DSPARK_NIXPKGS_LIB to the lib/ directory of a "
        "nix-community/nixpkgs.lib checkout to evaluate the NixOS module"
    )


def pytest_report_header(config):
    """Which nixpkgs.lib the module evaluations run against (its release, from lib/.version)."""
    env = os.environ.get("DSPARK_NIXPKGS_LIB")
    for path in [Path(env)] if env else NIXPKGS_LIB_CANDIDATES:
        version = path / ".version"
        if version.is_file():
            return f"nixpkgs.lib: {path} (release {version.read_text().strip()})"
    return None
