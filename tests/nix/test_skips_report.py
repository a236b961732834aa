""".ci/skips.py: the skips of a real pytest run counted by reason, from its JUnit XML and from its
-rs summary alike (CI prints them so that no skip goes unseen). Not a Nix test: it sits here
beside the Nix tests whose skips it was written for, and runs in the quick layer."""

from __future__ import annotations

import subprocess
import sys

from tests.nix.nix_support import REPO

SKIPS = REPO / ".ci" / "skips.py"

# Six skips under three reasons (one at collection time, in a module of its own), one xfail (not
# a skip), one pass.
TESTS = {
    "test_a.py": '''
import pytest

@pytest.mark.parametrize("n", [1, 2, 3])
@pytest.mark.skipif(True, reason="no frobnicator here")
def test_param(n):
    pass

def test_inside():
    pytest.skip("the cache is empty: fetch it")

@pytest.fixture
def needs():
    pytest.skip("no frobnicator here")

def test_fixture(needs):
    pass

@pytest.mark.xfail(reason="known bug")
def test_xfail():
    assert False

def test_pass():
    assert True
''',
    "test_b.py": '''
import pytest
pytest.skip("module needs root", allow_module_level=True)

def test_never():
    pass
''',
}

EXPECTED = """skipped: 6
     4  no frobnicator here
     1  module needs root
     1  the cache is empty: fetch it
"""


def run_skips(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SKIPS), *args], input=stdin, capture_output=True, text=True,
                          timeout=60)


def test_junit_and_summary_give_the_same_counts(tmp_path):
    for name, text in TESTS.items():
        (tmp_path / name).write_text(text)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-rs", "-p", "no:cacheprovider", "--color=yes",
                           f"--junitxml={tmp_path / 'junit.xml'}", str(tmp_path)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:]
    (tmp_path / "out.txt").write_text(proc.stdout)
    junit = run_skips(str(tmp_path / "junit.xml"))
    summary = run_skips(str(tmp_path / "out.txt"))
    assert junit.returncode == 0 and summary.returncode == 0, junit.stderr + summary.stderr
    assert junit.stdout == EXPECTED
    assert summary.stdout == EXPECTED
    # Two runs' reports (the quick and the slow layer) add up; "-" is standard input.
    both = run_skips(str(tmp_path / "junit.xml"), "-", stdin=proc.stdout)
    assert both.stdout.splitlines()[:2] == ["skipped: 12", "     8  no frobnicator here"]


def test_a_run_without_skips_says_zero(tmp_path):
    report = tmp_path / "junit.xml"
    report.write_text('<?xml version="1.0"?><testsuites><testsuite name="pytest" skipped="0">'
                      '<testcase classname="t" name="test_ok" time="0.1"/></testsuite></testsuites>')
    assert run_skips(str(report)).stdout == "skipped: 0\n"


def test_an_unreadable_report_is_one_line_exit_2(tmp_path):
    missing = run_skips(str(tmp_path / "nope.xml"))
    assert missing.returncode == 2 and missing.stderr.startswith("skips: cannot read ")
    broken = tmp_path / "broken.xml"
    broken.write_text("<testsuites><testcase>")
    bad = run_skips(str(broken))
    assert bad.returncode == 2 and bad.stderr.startswith("skips: ") and "Traceback" not in bad.stderr
    assert run_skips().returncode == 2
