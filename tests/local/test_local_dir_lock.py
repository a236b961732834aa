"""One local appliance per directory (issue 34, item 1): a second `local up` on a directory in use
is refused, naming the PID of the one running there, before it touches the directory (its cluster
file, logs and state stay as they were); `local down` stops the one running there and says so;
`local status` says whether one runs; a lock left by one killed outright is taken over, with a
line saying so, once the supervisors it left behind are stopped (`local down` stops them too).

The appliances here are the real `dspark local up`, its real supervisors and agents, on a
runtime line whose `bin/vllm` is the stand-in vLLM (tests/harness/standin_vllm.py): the lock is taken
before any vLLM starts, and none of this needs a real one. Each serves within seconds."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dspark.lines import runtime as runtime_lines
from dspark.local import cluster
from dspark.local import lock as dirlock
from tests.harness.pair import ROOT, dspark_cmd, kill_leftovers, pick_ports, run_dspark
from tests.harness.standin import STANDIN

READY = "Ctrl-C stops "
DEADLINE_S = 180  # a loaded 2-core host: the stand-in pair serves in seconds, this is the ceiling


@pytest.fixture
def standin_line(tmp_path) -> tuple[str, dict[str, str]]:
    """A runtime line other than the default whose vLLM is the stand-in, and the environment that
    points `local up` at it."""
    lines = runtime_lines.load()
    line = next(name for name in lines.lines if name != lines.default)
    exe = tmp_path / "lines" / line / "bin" / "vllm"
    exe.parent.mkdir(parents=True)
    exe.write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} {shlex.quote(str(STANDIN))} \"$@\"\n")
    exe.chmod(0o755)
    return line, {**os.environ, cluster.LINES_DIR_ENV: str(tmp_path / "lines")}


class Appliances:
    """Every `local up` a test starts, stopped (and swept) at its end whatever happened."""

    def __init__(self, workdir: Path, line: str, env: dict[str, str]):
        self.workdir, self.line, self.env = workdir, line, env
        self.procs: list[subprocess.Popen] = []

    def up_args(self, ports) -> list[str]:
        return ["local", "up", "--dir", str(self.workdir), "--line", self.line, "--api-port", str(ports.api),
                "--agent-port", str(ports.agent), "--master-port", str(ports.master)]

    def start(self, argv: list[str], out: Path) -> subprocess.Popen:
        with open(out, "wb") as f:
            p = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=self.env,
                                 start_new_session=True)
        self.procs.append(p)
        deadline = time.monotonic() + DEADLINE_S
        while READY not in out.read_text(errors="replace"):
            assert p.poll() is None, out.read_text(errors="replace")
            assert time.monotonic() < deadline, out.read_text(errors="replace")
            time.sleep(0.2)
        return p

    def run(self, *args: str, timeout: float = DEADLINE_S) -> subprocess.CompletedProcess:
        return run_dspark(*args, timeout=timeout, cwd=ROOT, env=self.env)

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
                try:
                    p.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait(timeout=10)
        kill_leftovers(self.workdir)


@pytest.fixture
def appliances(tmp_path, standin_line):
    a = Appliances(tmp_path / "d", *standin_line)
    try:
        yield a
    finally:
        a.close()


def snapshot(workdir: Path) -> dict[str, bytes]:
    """Every file under the directory but the logs, which the running appliance keeps writing
    (their names are compared apart)."""
    return {str(p.relative_to(workdir)): p.read_bytes() for p in workdir.rglob("*")
            if p.is_file() and "logs" not in p.parts}


def test_a_second_up_is_refused_naming_the_pid_and_down_stops_the_first(appliances, tmp_path):
    workdir = appliances.workdir
    first = appliances.start(dspark_cmd(*appliances.up_args(pick_ports())), tmp_path / "first.out")
    before, logs = snapshot(workdir), sorted(p.name for p in (workdir / "logs").iterdir())
    assert (workdir / dirlock.LOCK_NAME).read_text().strip() == str(first.pid)
    assert {"state/local-head/starts", "state/local-worker/starts"} <= set(before), sorted(before)

    # Other ports: once it started anyway, rewrote the cluster file, rotated the logs, deleted the state.
    r = appliances.run(*appliances.up_args(pick_ports()), timeout=60)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert f"is in use: another local appliance (PID {first.pid}) runs from it" in r.stderr, r.stderr
    assert "local down --dir" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert snapshot(workdir) == before and sorted(p.name for p in (workdir / "logs").iterdir()) == logs
    assert first.poll() is None

    # The first pair is the one status finds, still serving.
    s = appliances.run("status", "--config", str(workdir / "cluster.toml"), timeout=60)
    assert s.returncode == 0 and "pair: SERVING" in s.stdout, s.stdout + s.stderr
    s = appliances.run("local", "status", "--dir", str(workdir), timeout=60)
    assert s.returncode == 0 and f"running (PID {first.pid})" in s.stdout and "pair: SERVING" in s.stdout, s.stdout

    # local down: SIGTERM to that PID, waits for its stop, says what it did.
    t0 = time.monotonic()
    d = appliances.run("local", "down", "--dir", str(workdir))
    assert d.returncode == 0, d.stdout + d.stderr
    assert f"(PID {first.pid}): SIGTERM sent" in d.stdout and "stopped after" in d.stdout, d.stdout
    assert first.wait(timeout=30) == 0  # `local up`'s planned stop: exit 0
    assert time.monotonic() - t0 < DEADLINE_S
    out = (tmp_path / "first.out").read_text()
    assert "stopped; no process left behind" in out, out
    assert (workdir / dirlock.LOCK_NAME).read_text() == ""  # a clean stop leaves no PID to call stale
    assert dirlock.left_behind(workdir) == []

    # Nothing runs there now: refused clearly; status says so and what starts it.
    d = appliances.run("local", "down", "--dir", str(workdir), timeout=60)
    assert d.returncode == 1 and f"nothing runs from {workdir}" in d.stderr and "Traceback" not in d.stderr, d.stderr
    s = appliances.run("local", "status", "--dir", str(workdir), timeout=60)
    assert s.returncode == 1 and "not running" in s.stdout and "what to do: nothing answers" in s.stdout, s.stdout


def test_a_killed_appliance_is_taken_over_once_its_nodes_are_stopped(appliances, tmp_path):
    workdir = appliances.workdir
    ports = pick_ports()
    killed = appliances.start(dspark_cmd(*appliances.up_args(ports)), tmp_path / "killed.out")
    supervisors = dirlock.left_behind(workdir)
    assert len(supervisors) == 2, supervisors
    os.kill(killed.pid, signal.SIGKILL)  # `local up` killed outright: its supervisors run on
    killed.wait(timeout=30)
    assert dirlock.left_behind(workdir) == supervisors

    # Its lock is free but its nodes still serve from the directory: still refused, naming them.
    r = appliances.run(*appliances.up_args(pick_ports()), timeout=60)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert f"the supervisors {', '.join(map(str, supervisors))} still run from it" in r.stderr, r.stderr
    assert f"(PID {killed.pid})" in r.stderr, r.stderr
    s = appliances.run("local", "status", "--dir", str(workdir), timeout=60)
    assert "its `local up` is gone" in s.stdout and "pair: SERVING" in s.stdout, s.stdout

    d = appliances.run("local", "down", "--dir", str(workdir))
    assert d.returncode == 0 and "SIGTERM sent to each" in d.stdout and "stopped after" in d.stdout, d.stdout
    assert dirlock.left_behind(workdir) == []

    # Nothing answers now: status says how to start it again, and the command it prints does,
    # taking over the stale lock with one line that says so.
    s = appliances.run("status", "--config", str(workdir / "cluster.toml"), timeout=60)
    assert s.returncode == 1, s.stdout
    hint = next(line for line in s.stdout.splitlines() if line.startswith("what to do: nothing answers"))
    command = hint.split("(it writes this file again, as it is): ", 1)[1]
    assert f"--api-port {ports.api}" in command and f"--line {appliances.line}" in command, command
    again = appliances.start(shlex.split(command), tmp_path / "again.out")  # as printed, from the checkout
    out = (tmp_path / "again.out").read_text()
    taken = [line for line in out.splitlines() if "taking over" in line]
    assert taken == [f"taking over {workdir / dirlock.LOCK_NAME}: the appliance that held it (PID {killed.pid}) "
                     "ended without releasing it"], out
    assert (workdir / dirlock.LOCK_NAME).read_text().strip() == str(again.pid)
    d = appliances.run("local", "down", "--dir", str(workdir))
    assert d.returncode == 0 and again.wait(timeout=30) == 0, d.stdout + d.stderr


def test_a_lock_left_by_a_dead_process_is_taken_over_saying_so(tmp_path):
    """take_dir as `local up` calls it, in a process that dies holding the lock (SIGKILL: no
    release), then in this one; and a lock held by a live process is refused with its PID."""
    workdir = tmp_path / "d"
    code = ("import sys, time; from pathlib import Path; from dspark.local import lock as dirlock; "
            "dirlock.take_dir(Path(sys.argv[1])); print('held', flush=True); time.sleep(120)")
    holder = subprocess.Popen([sys.executable, "-c", code, str(workdir)], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        assert dirlock.holder(workdir) == dirlock.Holder(True, holder.pid)
        with pytest.raises(cluster.LocalError, match=f"another local appliance \\(PID {holder.pid}\\)"):
            dirlock.take_dir(workdir)
    finally:
        holder.kill()
        holder.communicate(timeout=30)
    assert dirlock.holder(workdir) == dirlock.Holder(False, stale=holder.pid)
    said: list[str] = []
    lock = dirlock.take_dir(workdir, said.append)
    try:
        assert said == [f"taking over {workdir / dirlock.LOCK_NAME}: the appliance that held it (PID {holder.pid}) "
                        "ended without releasing it"]
        assert dirlock.holder(workdir).pid == os.getpid()
    finally:
        lock.release()
    assert dirlock.holder(workdir) == dirlock.Holder(False)
    said.clear()
    dirlock.take_dir(workdir, said.append).release()
    assert said == []  # a clean release leaves nothing to take over
