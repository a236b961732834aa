"""What `dspark systemd render/install` writes, read back by systemd's own parser
(`systemd-analyze verify`, no running systemd needed): a `$` in the executable's path and a
config path with a space."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.harness.dspark_cli import invoke_dspark

FIXTURE = Path(__file__).parents[1] / "fixtures" / "cluster-two-node.toml"
needs_analyze = pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze here")


def verify(unit: Path) -> str:
    r = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60)
    return r.stdout + r.stderr


def fake_dspark(where: Path) -> Path:
    exe = where / "bin" / "dspark"
    exe.parent.mkdir(parents=True)
    exe.write_text("#!/bin/sh\nexit 0\n")
    exe.chmod(0o755)
    return exe


@needs_analyze
def test_dollar_in_dspark_bin_is_the_path_systemd_runs(tmp_path):
    exe = fake_dspark(tmp_path / "opt$HOME x")
    out = tmp_path / "units"
    r = invoke_dspark("systemd", "render", "--dspark-bin", str(exe), "--out", str(out))
    assert r.returncode == 0, r.stderr
    for unit in ("dspark-worker.service", "dspark-head.service", "dspark-wait-worker.service",
                 "dspark-dashboard.service"):
        said = verify(out / unit)
        assert "is not executable" not in said and "Failed" not in said, said


@needs_analyze
def test_config_path_with_a_space_reaches_the_units(tmp_path):
    conf_dir = tmp_path / "my cluster"
    conf_dir.mkdir()
    conf = conf_dir / "cluster 100%.toml"
    shutil.copy(FIXTURE, conf)
    exe = fake_dspark(tmp_path / "d")
    out = tmp_path / "units"
    r = invoke_dspark("systemd", "render", "--node", "spark-a", "--config", str(conf), "--dspark-bin", str(exe),
                   "--out", str(out))
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    dropin = (out / "dspark-head.service.d" / "50-dspark-node.conf").read_text()
    assert f'Environment="DSPARK_CONFIG={str(conf).replace("%", "%%")}"' in dropin
    said = verify(out / "dspark-head.service")
    assert "Invalid environment" not in said and "ignoring" not in said, said


def test_a_newline_in_the_config_path_is_a_clear_error(tmp_path):
    conf = tmp_path / "a\nb.toml"
    shutil.copy(FIXTURE, conf)
    r = invoke_dspark("systemd", "render", "--node", "spark-a", "--config", str(conf), "--dspark-bin", "/bin/true")
    assert r.returncode == 2 and "Traceback" not in r.stderr and "newline" in r.stderr, r.stderr
