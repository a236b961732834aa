"""`dspark overlay` as a user meets it: its help names the command that was
typed, and `overlay check`'s exit status says whether the series is applied (0) or not (3),
so that a script can act on it; an error stays 1."""

from __future__ import annotations

from tests.lines.test_overlay_applier import make, needs_patch, overlay_cli


def test_help_names_dspark_overlay(tmp_path):
    r = overlay_cli("--help", cwd=tmp_path)
    assert r.returncode == 0
    assert r.stdout.startswith("usage: dspark overlay "), r.stdout.splitlines()[0]
    assert "python -m" not in r.stdout
    assert "exit status" in r.stdout  # check's codes are documented where users look


@needs_patch
def test_check_exit_status_says_applied_or_not(tmp_path):
    site, overlay = make(tmp_path)
    r = overlay_cli("check", str(site), "--overlay-dir", str(overlay), cwd=tmp_path)
    assert r.returncode == 3 and "overlay not applied" in r.stdout, (r.returncode, r.stdout, r.stderr)
    assert overlay_cli("apply", str(site), "--overlay-dir", str(overlay), cwd=tmp_path).returncode == 0
    r = overlay_cli("check", str(site), "--overlay-dir", str(overlay), cwd=tmp_path)
    assert r.returncode == 0 and "overlay applied" in r.stdout
    r = overlay_cli("check", str(tmp_path / "nowhere"), "--overlay-dir", str(overlay), cwd=tmp_path)
    assert r.returncode == 1 and "Traceback" not in r.stderr


def test_overlay_readme_cites_only_files_in_this_repository():
    import re
    from pathlib import Path

    root = Path(__file__).parents[2]
    text = (root / "overlay" / "README.md").read_text()
    # paths this repository would hold: under its top-level directories (vLLM's own paths,
    # vllm/..., and other repositories' files named as theirs are not checked)
    cited = set(re.findall(r"`((?:shared|tests|nix|src|overlay|benchmarks|modules)/[\w./-]+)`", text))
    assert cited, "no file cited?"
    missing = sorted(p for p in cited if not (root / p).exists() and not (root / "overlay" / p).exists())
    assert not missing, missing
