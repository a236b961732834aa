"""Each line's local series: the platform-neutral patches of its series that .ci/setup applies to
the vLLM the local pair runs (.venv, .venv-lines/<line>), and the stock trees the overlay's checks
take from those installs (tests/overlay/stock_tree.py)."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from dspark.lines import runtime as runtime_lines
from dspark.lines.overlay import apply_series, is_applied, read_series

from .conftest import REPO, copy_vllm_tree, line_site, stock_tree

LINES = runtime_lines.load()


def local_series(line_id: str):
    return (REPO / LINES.get(line_id).series_file).parent / "local-series"


@pytest.mark.parametrize("line_id", sorted(LINES.lines))
def test_the_local_series_is_the_lines_own_patches_in_its_order(line_id):
    series = [p.resolve() for p in read_series(REPO / LINES.get(line_id).series_file)]
    local = [p.resolve() for p in read_series(local_series(line_id))]
    assert local and [p for p in series if p in local] == local
    assert [p.name for p in local] == ["0012-flashinfer-dsv4-eager-workspace.patch",
                                       "0013-shm-broadcast-busy-loop-env.patch"]
    assert stock_tree().local_series_files().count(local_series(line_id)) == 1


def installed(line_id: str):
    if line_id == LINES.default:
        from .conftest import installed_site_packages

        return installed_site_packages()
    site = line_site(line_id)
    if site is None:
        pytest.skip(f"no vLLM tree of line {line_id} here (.ci/setup installs it)")
    return site


@pytest.mark.parametrize("line_id", sorted(LINES.lines))
def test_the_local_pairs_vllm_carries_its_lines_local_series(line_id):
    # What .ci/setup leaves: `dspark overlay check` exits 0 on the tree the local pair runs.
    site = installed(line_id)
    r = subprocess.run([sys.executable, "-m", "dspark.lines.overlay", "check", str(site), "--series",
                        str(local_series(line_id))], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "overlay applied" in r.stdout, (r.stdout, r.stderr)


def test_a_copy_of_a_patched_install_is_stock_again(stock_site, tmp_path):
    # An install carrying the local series (as .ci/setup leaves .venv): its copy is stock, file for
    # file as the wheel's RECORD has it, and the whole series applies to it.
    install = tmp_path / "install"
    shutil.copytree(stock_site, install)
    apply_series(install, local_series(LINES.default))
    copy = copy_vllm_tree(install, tmp_path / "copy")
    assert not is_applied(copy, local_series(LINES.default))
    for rel in ("vllm/envs.py", "vllm/distributed/device_communicators/shm_broadcast.py",
                "vllm/models/deepseek_v4/nvidia/flashinfer_sparse.py"):
        assert (copy / rel).read_bytes() == (stock_site / rel).read_bytes(), rel
    assert apply_series(copy, REPO / LINES.get(LINES.default).series_file, dry_run=True)


def test_a_tree_patched_by_another_version_is_refused_with_the_fix(stock_site, tmp_path):
    install = tmp_path / "install"
    shutil.copytree(stock_site, install)
    shm = install / "vllm/distributed/device_communicators/shm_broadcast.py"
    shm.write_text(shm.read_text().replace("busy_loop_s: float = 1,", "busy_loop_s: float = 0.5,"))
    with pytest.raises(RuntimeError, match="differ from the wheel's RECORD .*run .ci/setup"):
        stock_tree().make_stock(install)
