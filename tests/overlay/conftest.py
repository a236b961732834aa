"""Fixtures of the overlay tests: copies of the installed vLLM tree."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
OVERLAY_DIR = REPO / "overlay"
CHECKS = Path(__file__).with_name("patched_checks.py")
# The CUDA wheel's vllm tree (unpacked), when a developer has one; CI has none.
CUDA_TREE_ENV = "DSPARK_VLLM_CUDA_SITE"


def installed_site_packages() -> Path:
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        pytest.skip("vLLM is not installed in this environment")
    return Path(spec.origin).resolve().parents[1]


def copy_vllm_tree(source_site: Path, dest_site: Path) -> Path:
    """Copy ``vllm/`` (and its dist-info) from one site-packages to another."""
    dest_site.mkdir(parents=True, exist_ok=True)
    shutil.copytree(
        source_site / "vllm",
        dest_site / "vllm",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    for dist in source_site.glob("vllm*.dist-info"):
        shutil.copytree(dist, dest_site / dist.name)
    return dest_site


def run_checks(site: Path, script: Path = CHECKS, *args: str, path: tuple[Path, ...] = (),
               env: dict[str, str] | None = None, timeout: float = 600) -> dict[str, str]:
    """Run a check script (default patched_checks.py) in a subprocess with ``site`` first
    on the path (then ``path``); parse the JSON it prints after @@RESULTS@@."""
    run_env = dict(os.environ, PYTHONPATH=os.pathsep.join(map(str, (site, *path))),
                   PYTHONDONTWRITEBYTECODE="1", **(env or {}))
    run_env.pop("PYTHONWARNINGS", None)
    result = subprocess.run(
        [sys.executable, str(script), str(site), *args],
        capture_output=True, text=True, env=run_env, timeout=timeout, check=False,
    )
    for line in result.stdout.splitlines():
        if line.startswith("@@RESULTS@@"):
            return json.loads(line[len("@@RESULTS@@"):])
    raise AssertionError(f"{script.name} did not report:\n{result.stdout}\n{result.stderr[-4000:]}")


@pytest.fixture(scope="session")
def stock_site(tmp_path_factory) -> Path:
    """A pristine copy of the installed vLLM 0.28.0 tree."""
    return copy_vllm_tree(installed_site_packages(), tmp_path_factory.mktemp("stock"))


@pytest.fixture(scope="session")
def patched_site(stock_site, tmp_path_factory) -> Path:
    """A copy of the tree with the whole series applied by dspark.overlay."""
    from dspark.overlay import apply_series

    site = tmp_path_factory.mktemp("patched")
    shutil.copytree(stock_site, site, dirs_exist_ok=True)
    apply_series(site, OVERLAY_DIR)
    return site


@pytest.fixture(scope="session")
def patched_results(patched_site) -> dict[str, str]:
    return run_checks(patched_site)
