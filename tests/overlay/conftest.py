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
    """Copy ``vllm/`` (and its dist-info) from one site-packages to another: a stock tree, with
    the line's local series (.ci/setup applies it to the local pair's vLLM) reversed."""
    dest_site.mkdir(parents=True, exist_ok=True)
    shutil.copytree(
        source_site / "vllm",
        dest_site / "vllm",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    for dist in source_site.glob("vllm*.dist-info"):
        shutil.copytree(dist, dest_site / dist.name)
    stock_tree().make_stock(dest_site)
    return dest_site


def stock_tree():
    """stock_tree.py, loaded by path: benchmarks load this conftest as a plain module."""
    spec = importlib.util.spec_from_file_location("dspark_stock_tree", Path(__file__).with_name("stock_tree.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_checks(site: Path, script: Path = CHECKS, *args: str, path: tuple[Path, ...] = (),
               env: dict[str, str] | None = None, timeout: float = 600,
               python: Path | str = sys.executable) -> dict[str, str]:
    """Run a check script of this folder (default patched_checks.py) in a subprocess of ``python``
    (default this one) as a module from the repository (``python -m tests.overlay.NAME``: its
    siblings import as tests.overlay.*) with ``site`` first on PYTHONPATH (then ``path``); parse
    the JSON it prints after @@RESULTS@@."""
    run_env = dict(os.environ, PYTHONPATH=os.pathsep.join(map(str, (site, *path))),
                   PYTHONDONTWRITEBYTECODE="1", **(env or {}))
    run_env.pop("PYTHONWARNINGS", None)
    result = subprocess.run(
        [str(python), "-m", f"tests.overlay.{Path(script).stem}", str(site), *args],
        capture_output=True, text=True, env=run_env, timeout=timeout, check=False, cwd=REPO,
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
    """A copy of the tree with the whole series applied by dspark.lines.overlay."""
    from dspark.lines.overlay import apply_series

    site = tmp_path_factory.mktemp("patched")
    shutil.copytree(stock_site, site, dirs_exist_ok=True)
    apply_series(site, OVERLAY_DIR)
    return site


@pytest.fixture(scope="session")
def patched_results(patched_site) -> dict[str, str]:
    return run_checks(patched_site)


# ------------------------------------------------------------------ runtime line v0.32.0

LINE_032 = "v0.32.0"
SITE_032_ENV = "DSPARK_VLLM_032_SITE"


def line_site(line: str = LINE_032) -> Path | None:
    """The line's vLLM tree: the site directory DSPARK_VLLM_032_SITE names, else the line's CPU
    build that .ci/setup installs beside .venv (dspark.local.cluster.lines_dir()/<line>)."""
    named = os.environ.get(SITE_032_ENV)
    if named:
        return Path(named)
    from dspark.local.cluster import lines_dir

    found = sorted((lines_dir() / line).glob("lib/python3*/site-packages"))
    return found[0] if found and (found[0] / "vllm").is_dir() else None


def line_python(site: Path) -> Path | str:
    """The interpreter of the virtual environment that holds ``site`` (its vLLM's own
    dependencies), else this one (a bare unpacked tree)."""
    python = site.parents[2] / "bin" / "python"
    return python if python.is_file() else sys.executable


@pytest.fixture(scope="session")
def stock_site_032(tmp_path_factory) -> Path:
    """A pristine copy of the vLLM 0.32.0 tree (skipped, saying why, when there is none)."""
    site = line_site()
    if site is None:
        pytest.skip(f"no vLLM 0.32.0 tree here: neither .venv-lines/{LINE_032} (.ci/setup installs it) nor "
                    f"{SITE_032_ENV} (a vLLM 0.32.0 site directory)")
    return copy_vllm_tree(site, tmp_path_factory.mktemp("stock032"))


@pytest.fixture(scope="session")
def python_032() -> Path | str:
    site = line_site()
    if site is None:
        pytest.skip("no vLLM 0.32.0 tree here")
    return line_python(site)


@pytest.fixture(scope="session")
def patched_site_032(stock_site_032, tmp_path_factory) -> Path:
    """A copy of the 0.32.0 tree with the v0.32.0 line's series applied by dspark.lines.overlay."""
    from dspark.lines.overlay import apply_series, line_series

    site = tmp_path_factory.mktemp("patched032")
    shutil.copytree(stock_site_032, site, dirs_exist_ok=True)
    apply_series(site, line_series(LINE_032))
    return site


def _flag_values(argv: list[str], name: str) -> list[int]:
    i = argv.index(name) + 1
    values = []
    while i < len(argv) and not argv[i].startswith("--"):
        values.append(int(argv[i]))
        i += 1
    return values


@pytest.fixture(scope="session")
def rendered_032(tmp_path_factory) -> dict:
    """What dspark renders for the template cluster (tests/fixtures/cluster-two-node.toml) on the
    v0.32.0 line: vLLM's capture sizes (which kernel_warmup hands b12x_warmup), its token budget,
    the speculative tokens and max_num_seqs."""
    import tomllib

    from dspark.config import validate as C
    from dspark.config.template import dumps
    from dspark.node.launch import vllm_argv

    data = tomllib.loads((REPO / "tests" / "fixtures" / "cluster-two-node.toml").read_text())
    data["serving"]["runtime_line"] = LINE_032
    path = tmp_path_factory.mktemp("rendered032") / "cluster.toml"
    path.write_text(dumps(data))
    cluster = C.load(path)
    argv = vllm_argv(cluster, cluster.head)
    return {"sizes": _flag_values(argv, "--cudagraph-capture-sizes"),
            "max_batched": _flag_values(argv, "--max-num-batched-tokens")[0],
            "k": cluster.serving.num_speculative_tokens, "max_seqs": cluster.serving.max_num_seqs}
