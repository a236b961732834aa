"""Every runtime dependency in pyproject.toml is also in the Nix package (nix/package.nix),
so the CLI the flake builds imports what the venv's does."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

REPO = Path(__file__).parents[2]


def test_nix_package_carries_every_pyproject_dependency():
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {re.split(r"[<>=!~ \[;]", d, maxsplit=1)[0].lower().replace("_", "-") for d in deps}
    text = (REPO / "nix" / "package.nix").read_text()
    block = re.search(r"dependencies = with python3Packages; \[(.*?)\];", text, re.S)
    assert block, "nix/package.nix has no dependencies list"
    assert names <= set(block.group(1).split()), names - set(block.group(1).split())
