"""bench on the local pair as a new user runs it: `bench prefill` with its
default lengths runs (those that fit the pair's max_model_len of 4,096, and it says which it left
out), and a run whose every measured trial came from the prefix cache exits 1 and says why."""

import pytest

from dspark.bench.report import Report
from tests.harness.pair import run_dspark

pytestmark = pytest.mark.pair


def test_prefill_defaults_run_on_the_local_pair(local_pair, tmp_path):
    r = run_dspark("bench", "prefill", "--url", local_pair.api_url, "--trials", "1", "--seed", "21",
                   "-o", str(tmp_path), timeout=300)
    assert r.returncode == 0, r.stderr
    report = Report.load(tmp_path / "prefill-run.json")
    assert report.params["lengths"] == [1024, 2048] and report.complete
    assert "left out the default lengths 4096, 8192, 16384, 32768" in r.stdout, r.stdout


def test_every_trial_from_the_prefix_cache_exits_1_and_says_so(local_pair, tmp_path):
    args = ["bench", "prefill", "--url", local_pair.api_url, "--lengths", "512", "--trials", "2", "--seed", "22",
            "-o", str(tmp_path), "--quiet", "--shared-prefix-cache"]  # no per-run salt: the rerun hits the cache
    first = run_dspark(*args, "--label", "first", timeout=180)
    assert first.returncode == 0, first.stderr
    again = run_dspark(*args, "--label", "again", timeout=180)
    assert again.returncode == 1, (again.stdout, again.stderr)
    assert "prefix cache" in again.stderr and "--seed" in again.stderr, again.stderr
    assert (tmp_path / "prefill-again.json").exists()  # the report is still written
