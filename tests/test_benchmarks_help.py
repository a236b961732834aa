"""The benchmark scripts' --help speaks to a user: no tracker issue numbers,
which mean nothing outside the project's own history."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = sorted((Path(__file__).parents[1] / "benchmarks").glob("*.py"))


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_help_names_no_issue_number(script):
    r = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert not re.search(r"\bissue \d+", r.stdout, re.I), r.stdout
