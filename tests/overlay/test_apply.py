"""The series applies in order, refuses foreign trees and never half-patches."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pytest

from dspark.lines.overlay import (
    OverlayError,
    apply_series,
    installed_vllm_version,
    is_applied,
    main,
    read_series,
    touched_files,
)

from .conftest import CUDA_TREE_ENV, OVERLAY_DIR, copy_vllm_tree


def _digests(site: Path, rels) -> dict[str, str | None]:
    out = {}
    for rel in rels:
        path = site / rel
        out[rel] = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None
    return out


def _all_touched() -> list[str]:
    return list(dict.fromkeys(p for patch in read_series(OVERLAY_DIR) for p in touched_files(patch)))


def test_series_lists_every_patch_in_order():
    names = [p.name for p in read_series(OVERLAY_DIR)]
    assert names == sorted(names)
    assert names == sorted(p.name for p in OVERLAY_DIR.glob("*.patch"))
    for patch in read_series(OVERLAY_DIR):
        header = patch.read_text().split("\ndiff --git", 1)[0]
        assert "Drop when:" in header and "Seed behaviour:" in header, patch.name


def test_series_applies_to_the_cpu_wheel_tree(stock_site, patched_site):
    assert installed_vllm_version(stock_site) == "0.28.0"
    assert not is_applied(stock_site, OVERLAY_DIR)
    assert is_applied(patched_site, OVERLAY_DIR)
    touched = _all_touched()
    before, after = _digests(stock_site, touched), _digests(patched_site, touched)
    assert all(before[rel] != after[rel] for rel in touched)
    assert before["vllm/utils/spark_sm12x.py"] is None


def test_series_applies_to_the_cuda_wheel_tree(tmp_path):
    cuda_site = os.environ.get(CUDA_TREE_ENV)
    if not cuda_site:
        pytest.skip(
            f"{CUDA_TREE_ENV} is unset: no unpacked CUDA vllm==0.28.0 wheel here "
            "(CI does not download the 300 MB wheel; see overlay/README.md)"
        )
    site = copy_vllm_tree(Path(cuda_site), tmp_path / "cuda")
    assert installed_vllm_version(site) == "0.28.0"
    assert len(apply_series(site, OVERLAY_DIR)) == len(read_series(OVERLAY_DIR))
    assert is_applied(site, OVERLAY_DIR)


def test_dry_run_changes_nothing(stock_site):
    touched = _all_touched()
    before = _digests(stock_site, touched)
    names = apply_series(stock_site, OVERLAY_DIR, dry_run=True)
    assert names == [p.name for p in read_series(OVERLAY_DIR)]
    assert _digests(stock_site, touched) == before


def _small_tree(tmp_path: Path, stock_site: Path, version: str = "0.28.0") -> Path:
    site = tmp_path / "site"
    for rel in _all_touched():
        src = stock_site / rel
        if src.is_file():
            (site / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, site / rel)
    (site / "vllm" / "_version.py").write_text(
        f"__version__ = version = {version!r}\n"
    )
    return site


def test_wrong_version_is_refused(tmp_path, stock_site, capsys):
    site = _small_tree(tmp_path, stock_site, version="0.29.0")
    touched = _all_touched()
    before = _digests(site, touched)
    with pytest.raises(OverlayError, match="written for vLLM 0.28.0.*holds vLLM 0.29.0"):
        apply_series(site, OVERLAY_DIR)
    assert _digests(site, touched) == before
    assert main(["apply", str(site)]) == 1
    err = capsys.readouterr().err
    assert "vLLM 0.29.0" in err and "Traceback" not in err


def _last_patch_of_a_stock_file(site) -> tuple[Path, str, str]:
    """The latest patch that changes a file of stock vLLM, that file, and the first
    line the patch removes there."""
    for patch in reversed(read_series(OVERLAY_DIR)):
        path = None
        for line in patch.read_text().splitlines():
            if line.startswith("--- a/"):
                path = line[len("--- a/"):]
                path = path if (site / path).is_file() else None
            elif path and line.startswith("-") and not line.startswith("---") and line[1:].strip():
                return patch, path, line[1:]
    raise AssertionError("no patch changes a stock file")


def test_failing_patch_leaves_the_tree_stock(tmp_path, stock_site):
    site = _small_tree(tmp_path, stock_site)
    # Break a late patch only (a line it removes from a stock file): the
    # patches before it would apply.
    last, path, removed = _last_patch_of_a_stock_file(site)
    assert last.name != read_series(OVERLAY_DIR)[0].name
    target = site / path
    text = target.read_text()
    assert removed in text
    target.write_text(text.replace(removed, removed + "  # changed locally", 1))
    touched = _all_touched()
    before = _digests(site, touched)
    with pytest.raises(OverlayError, match=last.name):
        apply_series(site, OVERLAY_DIR)
    assert _digests(site, touched) == before
    assert not (site / "vllm/utils/spark_sm12x.py").exists()


def test_second_apply_is_refused(tmp_path, stock_site):
    site = _small_tree(tmp_path, stock_site)
    apply_series(site, OVERLAY_DIR)
    patched = _digests(site, _all_touched())
    with pytest.raises(OverlayError, match="already carries"):
        apply_series(site, OVERLAY_DIR)
    assert _digests(site, _all_touched()) == patched


def test_missing_tree_is_a_clear_error(tmp_path):
    with pytest.raises(OverlayError, match="no vllm package"):
        apply_series(tmp_path, OVERLAY_DIR)


HEADER_FIELDS = ("What:", "Why:", "Upstream:", "Seed behaviour:", "Drop when:")


@pytest.mark.parametrize("name", [p.name for p in read_series(OVERLAY_DIR)])
def test_every_patch_header_says_what_why_upstream_seed_and_when_to_drop(name):
    text = (OVERLAY_DIR / name).read_text()
    header = text[:text.index("\ndiff --git ")]
    lines = header.splitlines()
    for field in HEADER_FIELDS:
        hits = [ln for ln in lines if ln.startswith(field)]
        assert len(hits) == 1, f"{name}: {field} appears {len(hits)} times in the header"
        assert hits[0][len(field):].strip(), f"{name}: {field} is empty"
