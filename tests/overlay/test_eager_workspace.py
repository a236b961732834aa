"""Patch 0012 through vLLM's own DeepSeek V4 SM120 attention class: a prefill (always eager)
never receives the FlashInfer workspace that a captured decode graph holds (vLLM #56771),
on both lines; on the series without 0012 it does (workspace_checks.py, run in a subprocess
per tree)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from .conftest import OVERLAY_DIR, REPO, run_checks

CHECKS = Path(__file__).with_name("workspace_checks.py")
PATCH = "0012-flashinfer-dsv4-eager-workspace.patch"
APART = ("prefill apart from the captured decodes' workspace",
         "eager decode apart from the captured decodes' workspace")


def run_workspace_checks(site: Path, dtype: str = "nvfp4_ds_mla", **kwargs) -> dict[str, str]:
    return run_checks(site, CHECKS, dtype, timeout=900, path=(REPO / "src",), **kwargs)  # dspark.lines.runtime


def series_without(tmp: Path, series: Path, name: str) -> Path:
    """A series file in `tmp` naming every patch of `series` but `name`, in order."""
    from dspark.lines.overlay import read_series

    kept = [os.path.relpath(p.resolve(), tmp) for p in read_series(series) if p.name != name]
    text = series.read_text()
    version = [ln for ln in text.splitlines() if ln.startswith("# vllm-version:")]
    (tmp / "series").write_text("\n".join([*version, *kept]) + "\n")
    return tmp / "series"


def test_a_prefill_never_receives_the_workspace_a_captured_decode_holds(patched_site):
    r = run_workspace_checks(patched_site)
    assert r["calls"] == "ok", r
    seen = json.loads(r["seen"])
    # Decode batches ran captured and prefills (pure and mixed) eagerly, through the class's own
    # _forward_decode / _forward_prefill; none of the captured calls was a prefill.
    assert seen["captured decode"] > 0 and seen["eager prefill"] > 0 and seen["eager decode"] > 0, seen
    assert seen["captured prefill"] == 0, seen
    for key in APART:
        assert r[key] == "ok", (key, r[key])
    # One buffer for every captured graph (as before), both reserved by the eager profile run,
    # each of the 128 MiB vLLM gives FlashInfer; nothing allocated while capturing.
    assert r["captured decodes share one workspace"] == "ok"
    assert json.loads(r["held after the profile run"]) == {"_flashinfer_dsv4_workspace_by_device": 1,
                                                          "_flashinfer_dsv4_eager_workspace_by_device": 1}
    assert r["nothing allocated after the profile run"] == "ok"
    assert json.loads(r["workspace sizes"]) == [128 * 1024 * 1024]


def test_without_0012_a_prefill_gets_the_captured_decodes_workspace(stock_site, tmp_path):
    from dspark.lines.overlay import apply_series

    site = tmp_path / "site"
    shutil.copytree(stock_site, site)
    (tmp_path / "series").mkdir()
    apply_series(site, series_without(tmp_path / "series", OVERLAY_DIR / "series", PATCH))
    r = run_workspace_checks(site)
    assert r["calls"] == "ok", r
    for key in APART:
        assert "overlap(s)" in r[key], (key, r[key])
    assert json.loads(r["held after the profile run"]) == {"_flashinfer_dsv4_workspace_by_device": 1}


def test_the_v032_line_keeps_the_workspaces_apart(patched_site_032, python_032):
    r = run_workspace_checks(patched_site_032, python=python_032)
    assert r["calls"] == "ok", r
    for key in APART:
        assert r[key] == "ok", (key, r[key])
    assert r["nothing allocated after the profile run"] == "ok"
