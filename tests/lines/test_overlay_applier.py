"""The overlay applier on small trees of its own: a relative --overlay-dir,
a read-only tree, a malformed _version.py and a patch naming a path outside the tree are clear
errors; a patch whose context does not match exactly is refused (no fuzz)."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from tests.harness.pair import run_dspark

ORIGINAL = "".join(f"line {i}\n" for i in range(1, 13))
PATCH = """\
Seed behaviour: none. Drop when: never (a test patch).
diff --git a/vllm/x.py b/vllm/x.py
--- a/vllm/x.py
+++ b/vllm/x.py
@@ -3,7 +3,7 @@
 line 3
 line 4
 line 5
-line 6
+line six
 line 7
 line 8
 line 9
"""

needs_patch = pytest.mark.skipif(shutil.which("patch") is None, reason="GNU patch is not installed")


def make(tmp: Path, patch: str = PATCH, version: str = "__version__ = version = '0.28.0'\n") -> tuple[Path, Path]:
    site = tmp / "site"
    (site / "vllm").mkdir(parents=True)
    (site / "vllm" / "_version.py").write_text(version)
    (site / "vllm" / "x.py").write_text(ORIGINAL)
    overlay = tmp / "overlay"
    overlay.mkdir()
    (overlay / "0001-test.patch").write_text(patch)
    (overlay / "series").write_text("0001-test.patch\n")
    return site, overlay


def overlay_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return run_dspark("overlay", *args, cwd=cwd, timeout=60)


@needs_patch
def test_the_small_tree_applies_and_checks(tmp_path):
    site, overlay = make(tmp_path)
    r = overlay_cli("apply", str(site), "--overlay-dir", str(overlay), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "line six" in (site / "vllm" / "x.py").read_text()
    r = overlay_cli("check", str(site), "--overlay-dir", str(overlay), cwd=tmp_path)
    assert r.returncode == 0 and "overlay applied" in r.stdout


@needs_patch
def test_relative_overlay_dir_and_site(tmp_path):
    site, overlay = make(tmp_path)
    r = overlay_cli("apply", "site", "--overlay-dir", "overlay", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "line six" in (site / "vllm" / "x.py").read_text()
    r = overlay_cli("check", "site", "--overlay-dir", "overlay", cwd=tmp_path)
    assert r.returncode == 0 and "overlay applied" in r.stdout, r.stdout + r.stderr


@needs_patch
def test_no_fuzz_a_corrupted_context_line_is_refused(tmp_path):
    site, overlay = make(tmp_path, PATCH.replace(" line 3\n", " line three\n"))
    r = overlay_cli("apply", str(site), "--overlay-dir", str(overlay), cwd=tmp_path)
    assert r.returncode == 1 and "does not apply" in r.stderr, r.stdout + r.stderr
    assert (site / "vllm" / "x.py").read_text() == ORIGINAL


@needs_patch
@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_read_only_tree_is_a_clear_error(tmp_path):
    site, overlay = make(tmp_path)
    for p in (site / "vllm" / "x.py", site / "vllm"):
        p.chmod(p.stat().st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
    try:
        r = overlay_cli("apply", str(site), "--overlay-dir", str(overlay), cwd=tmp_path)
    finally:
        (site / "vllm").chmod(0o755)
        (site / "vllm" / "x.py").chmod(0o644)
    assert r.returncode == 1 and "Traceback" not in r.stderr and "cannot write" in r.stderr, r.stderr
    assert (site / "vllm" / "x.py").read_text() == ORIGINAL


@needs_patch
def test_unwritable_target_is_a_clear_error_even_as_root(tmp_path):
    """A target that cannot be replaced (a directory where the new file should be) fails the copy:
    a clear error and the tree as it was, whoever runs it."""
    site, overlay = make(tmp_path)
    patch = PATCH + """\
diff --git a/vllm/y.py b/vllm/y.py
new file mode 100644
--- /dev/null
+++ b/vllm/y.py
@@ -0,0 +1 @@
+new
"""
    (overlay / "0001-test.patch").write_text(patch)
    (site / "vllm" / "y.py").mkdir()  # where the new file goes, a directory that is not empty
    (site / "vllm" / "y.py" / "keep").write_text("")
    r = overlay_cli("apply", str(site), "--overlay-dir", str(overlay), cwd=tmp_path)
    assert r.returncode == 1 and "Traceback" not in r.stderr and "cannot write" in r.stderr, r.stderr
    assert (site / "vllm" / "x.py").read_text() == ORIGINAL


@pytest.mark.parametrize("version", ["__version__ = (", "\xff\xfe garbage", "__version__ = 1 +", ""])
def test_malformed_version_file_is_a_clear_error(tmp_path, version):
    site, overlay = make(tmp_path)
    (site / "vllm" / "_version.py").write_bytes(version.encode("latin-1"))
    r = overlay_cli("check", str(site), "--overlay-dir", str(overlay), cwd=tmp_path)
    assert r.returncode == 1 and "Traceback" not in r.stderr and "_version.py" in r.stderr, r.stderr


@pytest.mark.parametrize("path", ["/etc/passwd", "../../outside.py", "vllm/../../outside.py"])
def test_patch_naming_a_path_outside_the_tree_is_refused(tmp_path, path):
    patch = PATCH.replace("a/vllm/x.py", f"a/{path}").replace("b/vllm/x.py", f"b/{path}")
    site, overlay = make(tmp_path, patch)
    r = overlay_cli("apply", str(site), "--overlay-dir", str(overlay), cwd=tmp_path)
    assert r.returncode == 1 and "Traceback" not in r.stderr and "outside" in r.stderr, r.stderr
    assert not (tmp_path / "outside.py").exists()
