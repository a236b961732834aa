"""A runtime-line switch under systemd's notify protocol (`dspark serve` as a real process with
a stand-in vLLM and a real notify socket): the switch ends vLLM's run and starts the next one on
the new line in the same process, so the unit is not stopping. STOPPING=1 cannot be taken back:
systemd would keep the unit deactivating and kill it TimeoutStopSec later, in the middle of the
switch (tests/systemd/test_switch_under_systemd.py saw the worker killed, result 'timeout')."""

from __future__ import annotations

import fcntl
import json
import subprocess
import sys
import time
import tomllib

import pytest

from dspark.config.template import dumps
from dspark.files import state_io
from dspark.lines import history as switch_history
from dspark.lines import state as line_state
from dspark.local import cluster as local
from dspark.local.model import TINY_MODEL
from tests.harness.pair import dspark_cmd
from tests.harness.standin import STANDIN, write_cluster

A, B = "v0.28.0", "v0.32.0"


def switch_running(state_dir, request) -> None:
    """A switch runs, holding its lock as dspark switch does, until the test ends: the head
    leaves the switch record written by the test to it (dspark.lines.history)."""
    state_dir.mkdir(exist_ok=True)
    lock = state_io.open_lock(state_dir / switch_history.LOCK)
    fcntl.flock(lock, fcntl.LOCK_EX)
    request.addfinalizer(lock.close)


def test_a_switch_restarts_vllm_on_the_new_line_without_stopping_the_unit(tmp_path, serve, request):  # noqa: F811
    path = write_cluster(tmp_path, drain_s=1.0)
    data = tomllib.loads(path.read_text())
    data["serving"]["line_commands"] = {A: [sys.executable, str(STANDIN)], B: [sys.executable, str(STANDIN)]}
    path.write_text(dumps(data))
    s = serve(path, "h", STANDIN_READY_DELAY=0.5)
    s.read(until="READY=1")
    before = len(s.messages)
    switch_running(tmp_path / "state-h", request)
    line_state.write(tmp_path / "state-h", line_state.LineState(B, A, line_state.Switch("t", A, B, time.time())))
    deadline, st = time.monotonic() + 60, {}
    while time.monotonic() < deadline:
        s.read(timeout=0.5)
        st = s.state()
        if st["state"] == "serving" and st["runtime_line"] == B:
            break
    assert st["state"] == "serving" and st["runtime_line"] == B, st
    s.read(until="WATCHDOG=1", timeout=10)  # the watchdog runs on, on the new line
    after = s.messages[before:]
    assert any("switching from runtime line" in m for m in after), after
    assert not any(m.startswith("STOPPING=1") or "\nSTOPPING=1" in m for m in after), after
    assert s.proc.poll() is None


def test_a_worker_restarted_alone_on_another_line_than_its_heads_follows_the_head(tmp_path, serve):
    """During a rollback the head goes back to the old line while a worker that systemd restarts
    on its own still has the new line in its state. The worker's start check (`serve --check`,
    what the units run) must not refuse the pair's line: an exit 2 is never restarted
    (RestartPreventExitStatus=2). It starts, follows its head onto the head's line and the pair
    serves there."""
    second = local.lines_dir() / B / "bin" / "python"  # B's stand-in runs where B's vLLM is installed
    if not second.exists():
        pytest.skip(f"runtime line {B} is not installed here (.ci/setup puts it in {local.lines_dir()})")
    path = write_cluster(tmp_path, nodes=2, worker_wait_timeout_s=120.0)
    (tmp_path / "model" / "config.json").write_text(json.dumps(TINY_MODEL))  # the check reads it
    data = tomllib.loads(path.read_text())
    data["serving"]["line_commands"] = {A: [sys.executable, str(STANDIN)], B: [str(second), str(STANDIN)]}
    data["serving"]["load_format"] = "dummy"  # no shards: the stand-in loads nothing
    path.write_text(dumps(data))
    line_state.write(tmp_path / "state-h", line_state.LineState(A, A, line_state.Switch("t-rollback", B, A,
                                                                                          time.time(), rollback=True)))
    line_state.write(tmp_path / "state-w", line_state.LineState(B, A))
    h = serve(path, "h")
    h.read(until="STATUS=rendezvous")  # the head waits for its worker
    w = serve(path, "w", "--check")
    deadline, states = time.monotonic() + 90, ({}, {})
    while time.monotonic() < deadline and w.proc.poll() is None:
        h.read(timeout=0.2)  # (the notify sockets read, as systemd does)
        w.read(timeout=0.2)
        try:
            states = (h.state(), w.state())
        except OSError:
            continue
        if all(st.get("state") == "serving" for st in states):
            break
    out = w.proc.stdout.read() if w.proc.poll() is not None else ""
    assert w.proc.poll() is None, (w.proc.returncode, [x for x in out.splitlines() if "fail" in x])
    assert [(st["state"], st["runtime_line"]) for st in states] == [("serving", A)] * 2, states
    assert line_state.current(tmp_path / "state-w", A).line == A  # it comes back on the pair's line


def test_dspark_switch_to_a_line_that_cannot_start_rolls_the_pair_back_to_the_old_line(tmp_path, serve):
    """`dspark switch` itself (the CLI an operator runs on the head) with the pair on the stand-in:
    the new line's vLLM cannot even import (a broken install), so the switch ends `rolled back`,
    exit 1, with both nodes serving the old line again and the failure in the history. The
    kept switch and the regression gate run between two real vLLM releases
    (tests/switch/test_switch_local.py, tests/systemd/test_switch_under_systemd.py)."""
    path = write_cluster(tmp_path, nodes=2, drain_s=1.0, worker_wait_timeout_s=60.0)
    data = tomllib.loads(path.read_text())
    broken = [sys.executable, "-c", "import sys; sys.exit('ImportError: vllm is broken in this install')"]
    data["serving"]["line_commands"] = {A: [sys.executable, str(STANDIN)], B: broken}
    path.write_text(dumps(data))
    h, w = serve(path, "h"), serve(path, "w")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        h.read(timeout=0.2)
        w.read(timeout=0.2)
        try:
            if h.state()["state"] == w.state()["state"] == "serving":
                break
        except OSError:
            continue
    assert (h.state()["state"], w.state()["state"]) == ("serving", "serving")
    with open(tmp_path / "switch.out", "w+") as log:
        r = subprocess.Popen(dspark_cmd("switch", B, "--no-bench", "--config", str(path), "--state-dir",
                                        str(tmp_path / "state-h"), "--timeout", "60"),
                             stdout=log, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 300
        while r.poll() is None and time.monotonic() < deadline:
            h.read(timeout=0.2)  # the notify sockets read, as systemd does
            w.read(timeout=0.2)
        if r.poll() is None:
            r.kill()
        r.wait(timeout=30)
        log.seek(0)
        out = log.read()
    assert r.returncode == 1, out
    assert "rolled back" in out and "Traceback" not in out, out
    rec = json.loads((tmp_path / "state-h" / "switch-history.json").read_text())[-1]
    assert rec["verdict"] == "rolled back" and f"failed on {B}" in rec["reason"] and rec["serving_on"] == A, rec
    assert 0 < rec["down_s"]
    assert [(st["state"], st["runtime_line"]) for st in (h.state(), w.state())] == [("serving", A)] * 2
    assert h.proc.poll() is None and w.proc.poll() is None  # inside the running supervisors


@pytest.mark.parametrize("wanted, said", [
    ("v0.29.0", "'v0.29.0' was retired"),
    # Issue 33, item 10: a switch under way to a line this cluster file does not install (348
    # "switching" cycles in 20 s before: serve fell back, the head's watch switched straight back).
    ("v0.32.0", "runtime line 'v0.32.0' is not installed on the nodes"),
])
def test_a_node_whose_state_names_a_line_it_cannot_run_serves_the_files_line_with_one_warning(
        tmp_path, serve, wanted, said, request):
    """v0.29.0 was retired (runtime_lines.toml `[retired]`), v0.32.0 is not in this file's
    line_commands: a node whose switch state names one (a pair switched there before the upgrade,
    or a switch to it under way) comes up on its cluster file's line, saying once why, instead of
    failing to start or switching back and forth."""
    path = write_cluster(tmp_path)
    (tmp_path / "model" / "config.json").write_text(json.dumps(TINY_MODEL))  # the check reads it
    data = tomllib.loads(path.read_text())
    data["serving"]["load_format"] = "dummy"  # no shards: the stand-in loads nothing
    path.write_text(dumps(data))
    record = line_state.Switch("s1", A, wanted, time.time()) if wanted == "v0.32.0" else None
    if record is not None:
        switch_running(tmp_path / "state-h", request)
    line_state.write(tmp_path / "state-h", line_state.LineState(wanted, A, record))
    s = serve(path, "h", "--check")  # as the units run it
    try:
        s.read(until="READY=1", timeout=60)
    except AssertionError:
        s.proc.kill()
        raise AssertionError(s.proc.stdout.read()[-3000:]) from None
    assert (s.state()["state"], s.state()["runtime_line"]) == ("serving", A)
    s.proc.kill()
    s.proc.wait(timeout=30)
    out = s.proc.stdout.read()
    warnings = [ln for ln in out.splitlines() if said in ln]
    assert len(warnings) == 1, out[-3000:]
    assert f"running the cluster file's line {A}" in warnings[0] and "Traceback" not in out, warnings
