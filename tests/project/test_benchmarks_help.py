"""The benchmark scripts' --help speaks to a user: no tracker issue numbers,
which mean nothing outside the project's own history."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).parents[2]
SCRIPTS = sorted(p for p in (REPO / "benchmarks").glob("*.py") if p.name != "__init__.py")


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_help_names_no_issue_number(script):
    r = subprocess.run([sys.executable, "-m", f"benchmarks.{script.stem}", "--help"], capture_output=True, text=True,
                       timeout=60, cwd=REPO)  # run as the docs say: a module, from the repository
    assert r.returncode == 0, r.stderr
    assert not re.search(r"\bissue \d+", r.stdout, re.I), r.stdout
