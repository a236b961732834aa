"""The texts a user installs, byte for byte: the cluster file's template (`dspark config init`)
and the systemd units with their drop-ins (`dspark systemd render`). The goldens were written by
the code before the package moved into subpackages (issue 35); a change to either text is a
change a reviewer sees here, not a side effect. The vLLM launch has its own goldens
(tests/node/test_render.py)."""

from __future__ import annotations

from pathlib import Path

from tests.harness.pair import run_dspark

TESTS = Path(__file__).resolve().parents[1]
GOLDEN = TESTS / "golden"
FIXTURE = TESTS / "fixtures" / "cluster-two-node.toml"


def test_the_template_is_byte_identical(tmp_path):
    out = tmp_path / "cluster.toml"
    r = run_dspark("config", "init", str(out))
    assert r.returncode == 0, r.stderr
    assert out.read_bytes() == (GOLDEN / "template.toml").read_bytes()


def test_the_units_and_drop_ins_are_byte_identical(tmp_path):
    r = run_dspark("systemd", "render", "-c", str(FIXTURE), "-n", "spark-a", "-n", "spark-b",
                   "--dspark-bin", "/usr/bin/dspark", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    want = {p.relative_to(GOLDEN / "units"): p.read_bytes()
            for p in sorted((GOLDEN / "units").rglob("*")) if p.is_file()}
    got = {p.relative_to(tmp_path): p.read_bytes().replace(str(FIXTURE).encode(), b"@CONFIG@")
           for p in sorted(tmp_path.rglob("*")) if p.is_file()}
    assert got == want


def test_the_printed_units_are_byte_identical():
    r = run_dspark("systemd", "render", "-c", str(FIXTURE), "--dspark-bin", "/usr/bin/dspark")
    assert r.returncode == 0, r.stderr
    assert r.stdout == (GOLDEN / "units.txt").read_text()
