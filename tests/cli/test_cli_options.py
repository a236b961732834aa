"""`--config` is declared once and honoured the same way by every command."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from tests.harness.pair import run_dspark

SRC = Path(__file__).parents[2] / "src" / "dspark"


def test_config_option_is_declared_once():
    found = [(p.relative_to(SRC), n) for p in SRC.rglob("*.py")
             for n, line in enumerate(p.read_text().splitlines(), 1)
             if re.search(r"click\.option\(\s*\"--config\"", line)]
    assert len(found) == 1, found


@pytest.mark.parametrize("args", [("dashboard", "--port", "0"), ("config", "check"), ("status",),
                                  ("systemd", "render", "--node", "x"), ("bench", "decode")])
def test_every_command_reads_dspark_config(tmp_path, args):
    missing = tmp_path / "from-the-environment.toml"
    env = {**os.environ, "DSPARK_CONFIG": str(missing)}
    r = run_dspark(*args, env=env, timeout=30)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert str(missing) in r.stderr, r.stderr
