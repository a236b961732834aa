"""A runtime-line switch with a fault injected at each step (issue 33, items 8, 9, 11 and 16): the
real `dspark switch` CLI against a pair of real supervisors (`dspark serve`) on the stand-in
vLLM, both lines installed (the stand-in for each). After every fault the pair serves one line,
the head's state carries no switch record, and the history says which line and why. The same
faults on the real local pair: tests/switch/test_switch_local.py.

  step                               fault                       before               now
  the head's state names the line    kill -9 of dspark switch    `switch` set for     recorded abandoned by the
  (restart), the after-benchmark                                 ever, every switch   head within seconds; the
                                                                 refused, failures    next switch runs; a failure
                                                                 held for hold_s      is not held
  the head's drain                   Ctrl-C                      rollback failed      rolled back (exit 1)
                                                                 (worker held)
  the rollback                       a second Ctrl-C             "not started"        abandoned, serving the old
                                                                                      line (exit 3)
  the worker follows                 its state directory full    worker exit, pair    kept (the worker warns)
                                                                 down
  the switch's record                the head's directory full   -                    refused, nothing changed
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

from dspark.config.template import dumps
from dspark.lines import state as line_state
from dspark.node.policy import EXIT_DIED
from tests.harness.pair import dspark_cmd
from tests.harness.standin import STANDIN, write_cluster
from tests.node.test_serve_transient import fill, tiny_tmpfs

A, B = "v0.28.0", "v0.32.0"
STANDIN_LINE = [sys.executable, str(STANDIN)]
# With STANDIN_TOKEN_S 0.1, one benchmark run takes about 3 s: long enough to be killed in.
BENCH = ["--concurrency", "1", "--input-len", "8", "--output-len", "32", "--rounds", "1", "--repeats", "2"]


def pump(nodes, until, timeout: float) -> bool:
    """Read the nodes' notify sockets (as systemd does) until `until()` holds or `timeout` passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for n in nodes:
            n.read(timeout=0.1)
        try:
            if until():
                return True
        except OSError:  # an agent between two runs
            continue
    return False


def outputs(nodes) -> str:
    """The nodes' logs (each node killed first): for a failure's message."""
    for n in nodes:
        n.proc.kill()
    return "\n----\n".join(n.proc.stdout.read()[-3000:] for n in nodes)


def lines_of(nodes) -> list[tuple[str, str]]:
    return [(s["state"], s["runtime_line"]) for s in (n.state() for n in nodes)]


def serving_pair(tmp_path: Path, serve, *, drain_s: float = 1.0, **env):
    """Head h and worker w serving line A, with A and B installed (the stand-in for each)."""
    path = write_cluster(tmp_path, nodes=2, drain_s=drain_s, worker_wait_timeout_s=120.0)
    data = tomllib.loads(path.read_text())
    data["serving"]["line_commands"] = {A: STANDIN_LINE, B: STANDIN_LINE}
    path.write_text(dumps(data))
    nodes = (serve(path, "h", **env), serve(path, "w", **env))
    assert pump(nodes, lambda: lines_of(nodes) == [("serving", A)] * 2, 90), lines_of(nodes)
    return path, nodes


class Switch:
    """`dspark switch LINE` on the head's state directory, its output in a file."""

    def __init__(self, tmp_path: Path, path: Path, line: str, *args: str):
        self.out = tmp_path / f"switch-{line}-{time.monotonic_ns()}.out"
        self.state_dir = tmp_path / "state-h"
        with open(self.out, "w") as f:
            self.proc = subprocess.Popen(dspark_cmd("switch", line, "--config", str(path), "--state-dir",
                                                    str(self.state_dir), "--timeout", "90", *args),
                                         stdout=f, stderr=subprocess.STDOUT, text=True)

    def text(self) -> str:
        return self.out.read_text()

    def finish(self, nodes, timeout: float = 240) -> int:
        pump(nodes, lambda: self.proc.poll() is not None, timeout)
        if self.proc.poll() is None:
            self.proc.kill()
        return self.proc.wait(timeout=30)


def head_state(tmp_path: Path) -> dict:
    return json.loads((tmp_path / "state-h" / "runtime-line.json").read_text())


def last_record(tmp_path: Path) -> dict:
    return last_record_in(tmp_path / "state-h")


def owned_by(tmp_path: Path, pid: int) -> bool:
    try:
        return (head_state(tmp_path).get("switch") or {}).get("owner_pid") == pid
    except (OSError, ValueError):
        return False


# ------------------------------------------------------------------ item 8: a switch killed
def ended(tmp_path: Path, verdict: str):
    def check() -> bool:
        return head_state(tmp_path).get("switch") is None and last_record(tmp_path)["verdict"] == verdict
    return check


def test_a_switch_killed_at_the_restart_is_rolled_back_by_the_head_and_the_next_switch_runs(tmp_path, serve):
    """Killed once the head's state names the new line, before that line serves: the head does
    what the switch would have done, rolls the pair back and records it. Before: `switch` set for
    ever, every later switch refused, a failure held for hold_s. (A stand-in that loads for 6 s:
    the head looks for its switch every 2 s, so it finds the new line not serving yet.)"""
    path, nodes = serving_pair(tmp_path, serve, STANDIN_READY_DELAY=6)
    sw = Switch(tmp_path, path, B, "--no-bench")
    assert pump(nodes, lambda: owned_by(tmp_path, sw.proc.pid), 120) and sw.proc.poll() is None, sw.text()
    os.kill(sw.proc.pid, signal.SIGKILL)
    sw.proc.wait(timeout=30)
    assert pump(nodes, ended(tmp_path, "rolled back"), 120), (head_state(tmp_path), outputs(nodes))
    rec = last_record(tmp_path)
    assert (rec["from_line"], rec["to_line"], rec["serving_on"]) == (A, B, A), rec
    assert f"pid {sw.proc.pid}" in rec["reason"] and "completed by the head (h)" in rec["reason"], rec
    assert pump(nodes, lambda: lines_of(nodes) == [("serving", A)] * 2, 90), outputs(nodes)
    back = Switch(tmp_path, path, B, "--no-bench")
    assert back.finish(nodes) == 0, back.text()
    assert "kept" in back.text() and last_record(tmp_path)["verdict"] == "kept"


def test_a_switch_killed_in_its_after_benchmark_is_abandoned_on_the_new_line_and_nothing_stays_held(
        tmp_path, serve):
    """Killed while it measures the new line, which serves: the head records it `abandoned`
    (serving the new line, not measured) and clears the record. A failure after that is a failure
    (both nodes end: systemd restarts them), not a hold for hold_s (120 s here)."""
    path, nodes = serving_pair(tmp_path, serve, STANDIN_TOKEN_S=0.1)
    sw = Switch(tmp_path, path, B, *BENCH)
    assert pump(nodes, lambda: f"bench {B}-after-1" in sw.text(), 180) and sw.proc.poll() is None, sw.text()
    os.kill(sw.proc.pid, signal.SIGKILL)
    sw.proc.wait(timeout=30)
    assert pump(nodes, ended(tmp_path, "abandoned"), 90), (head_state(tmp_path), sw.text())
    rec = last_record(tmp_path)
    assert rec["serving_on"] == B and f"pid {sw.proc.pid}" in rec["reason"] and "the head (h)" in rec["reason"], rec
    assert lines_of(nodes) == [("serving", B)] * 2 and nodes[0].state()["line_switch"] is None
    reports = [p for p in (tmp_path / "state-h" / "switches").rglob("*")]
    assert reports and all(p.stat().st_mode & 0o077 == 0 for p in reports), [oct(p.stat().st_mode) for p in reports]
    # The worker learns that the switch is over at its next poll of the head (every second): a
    # failure in the second before that still holds, until the head comes back (under systemd).
    pump(nodes, lambda: False, 3)
    os.kill(nodes[1].state()["vllm_pid"], signal.SIGKILL)
    assert pump(nodes, lambda: all(n.proc.poll() is not None for n in nodes), 90), outputs(nodes)
    assert [n.proc.returncode for n in nodes] == [EXIT_DIED, EXIT_DIED]


def test_a_switch_that_died_while_the_head_was_down_is_rolled_back_when_the_head_starts(tmp_path, serve):
    """A reboot during a switch: the record of a dead dspark switch, found at the head's start,
    is rolled back before the head reads its line, and completed once it serves."""
    path = write_cluster(tmp_path)
    data = tomllib.loads(path.read_text())
    data["serving"]["line_commands"] = {A: STANDIN_LINE, B: STANDIN_LINE}
    path.write_text(dumps(data))
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = line_state.Switch("s1", A, B, time.time(), owner_pid=int(gone.stdout), owner_start=1)
    line_state.write(tmp_path / "state-h", line_state.LineState(B, A, dead))
    s = serve(path, "h")
    s.read(until="READY=1", timeout=60)
    assert s.state()["runtime_line"] == A  # never started on B
    assert pump([s], ended(tmp_path, "rolled back"), 30), head_state(tmp_path)
    rec = last_record(tmp_path)
    assert (rec["id"], rec["serving_on"]) == ("s1", A), rec
    assert "at its start rolls the pair back" in rec["reason"] and "completed by the head (h)" in rec["reason"]
    r = subprocess.run(dspark_cmd("switch", "--history", "--config", str(path), "--state-dir",
                                  str(tmp_path / "state-h")), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and f"state directory is {tmp_path / 'state-h'}" in r.stdout, r.stdout + r.stderr
    assert "rolled back" in r.stdout


# ------------------------------------------------------------------ items 9 and 16: Ctrl-C
def test_ctrl_c_during_the_heads_drain_rolls_the_pair_back_and_a_second_one_leaves_it_to_the_nodes(
        tmp_path, serve):
    """The stand-in ignores SIGTERM, so the head's drain lasts drain_s + stop_grace_s (6 s): the
    Ctrl-C lands in it. Before: the head came back on the old line, the worker held for a line
    change that never came, `rollback failed` (exit 3). Now the worker follows its head back."""
    path, nodes = serving_pair(tmp_path, serve, drain_s=4.0, STANDIN_IGNORE_TERM=1)
    sw = Switch(tmp_path, path, B, "--no-bench")
    assert pump(nodes, lambda: nodes[0].state()["state"] == "stopping", 60), sw.text()
    sw.proc.send_signal(signal.SIGINT)
    assert sw.finish(nodes) == 1, sw.text()
    rec = last_record(tmp_path)
    assert (rec["verdict"], rec["serving_on"]) == ("rolled back", A) and "Ctrl-C" in rec["reason"], rec
    assert lines_of(nodes) == [("serving", A)] * 2
    assert head_state(tmp_path)["switch"] is None

    # Again, with a second Ctrl-C during the rollback: the switch stops waiting and says so; the
    # head completes the rollback and records it. Before: "not started: interrupted before the
    # switch", although the pair had left the old line.
    sw = Switch(tmp_path, path, B, "--no-bench")
    assert pump(nodes, lambda: nodes[0].state()["state"] == "stopping", 60), sw.text()
    sw.proc.send_signal(signal.SIGINT)
    assert pump(nodes, lambda: "rolling back" in sw.text(), 30), sw.text()
    sw.proc.send_signal(signal.SIGINT)
    assert sw.finish(nodes, timeout=60) == 3, sw.text()
    assert "the head completes the rollback" in sw.text() and "Traceback" not in sw.text()
    assert pump(nodes, ended(tmp_path, "rolled back"), 120), outputs(nodes)
    rec = last_record(tmp_path)
    assert rec["serving_on"] == A and "interrupted again" in rec["reason"] and "completed by the head" in rec["reason"]
    assert lines_of(nodes) == [("serving", A)] * 2


def test_sighup_to_the_switch_a_closed_terminal_is_a_ctrl_c(tmp_path, serve):
    path, nodes = serving_pair(tmp_path, serve)
    sw = Switch(tmp_path, path, B, "--no-bench")
    assert pump(nodes, lambda: owned_by(tmp_path, sw.proc.pid), 60), sw.text()
    sw.proc.send_signal(signal.SIGHUP)
    assert sw.finish(nodes) == 1, sw.text()
    assert last_record(tmp_path)["verdict"] == "rolled back"
    assert lines_of(nodes) == [("serving", A)] * 2


# ------------------------------------------------------------------ item 11: a full state directory
def test_a_full_worker_state_directory_during_a_switch_keeps_the_pair_on_the_new_line(tmp_path, serve):
    """Before: the worker's write of the pair's line raised ENOSPC out of serve (exit 5, or 2
    before that), the switch and its rollback timed out and the pair stayed down."""
    with tiny_tmpfs(tmp_path / "state-w") as state_w:
        path, nodes = serving_pair(tmp_path, serve)
        fill(state_w)
        sw = Switch(tmp_path, path, B, "--no-bench")
        assert sw.finish(nodes) == 0, sw.text()
        assert lines_of(nodes) == [("serving", B)] * 2
        nodes[1].proc.kill()
        out = nodes[1].proc.stdout.read()
        assert "cannot keep the pair's runtime line" in out and "No space left on device" in out, out[-3000:]


def test_a_full_head_state_directory_refuses_the_switch_with_nothing_changed(tmp_path, serve):
    with tiny_tmpfs(tmp_path / "state-h") as state_h:
        path, nodes = serving_pair(tmp_path, serve)
        fill(state_h)
        sw = Switch(tmp_path, path, B, "--no-bench")
        assert sw.finish(nodes, timeout=60) == 2, sw.text()
        assert "nothing changed" in sw.text() and "the filesystem is full" in sw.text() and str(state_h) in sw.text()
        assert lines_of(nodes) == [("serving", A)] * 2
        assert not (state_h / "runtime-line.json").exists()


# ------------------------------------------------------------------ the resolution itself
def test_a_record_whose_switch_holds_the_lock_is_left_alone_and_a_rollback_past_its_time_fails(tmp_path):
    import fcntl

    from dspark.files import state_io
    from dspark.lines import history as switch_history

    rollback = line_state.Switch("s1-rollback", B, A, time.time() - 100, rollback=True)
    line_state.write(tmp_path, line_state.LineState(A, A, rollback))
    lock = state_io.open_lock(tmp_path / switch_history.LOCK)
    fcntl.flock(lock, fcntl.LOCK_EX)  # a running switch
    try:
        assert switch_history.resolve_abandoned(tmp_path, A, by="t", serving_on=A, limit_s=60) is None
        assert line_state.read(tmp_path).switch == rollback
    finally:
        lock.close()
    # Not serving, younger than the limit: the way back goes on. Older: it failed, and says so.
    assert switch_history.resolve_abandoned(tmp_path, A, by="t", serving_on=None, limit_s=600) is None
    rec = switch_history.resolve_abandoned(tmp_path, A, by="the head (h)", serving_on=None, limit_s=60)
    assert rec is not None and rec.verdict == "rollback failed" and "within 60 s" in rec.reason
    assert line_state.read(tmp_path).switch is None and last_record_in(tmp_path)["id"] == "s1"


def last_record_in(state_dir: Path) -> dict:
    return json.loads((state_dir / "switch-history.json").read_text())[-1]


def test_the_switch_prints_the_one_figure_its_verdict_used_with_its_band(tmp_path, serve):
    """Issue 34, item 3: a switch printed a -31.2 % table, then `kept ... -3.4 %`: which figure did
    the verdict use? It says so now: the score of each line (its runs listed), the gain, the band
    and how each was formed, after the table, which is marked as not the verdict."""
    path, nodes = serving_pair(tmp_path, serve)
    sw = Switch(tmp_path, path, B, *BENCH, "--min-band", "0.9")
    assert sw.finish(nodes) == 0, sw.text()
    out = sw.text()
    rec = last_record(tmp_path)
    figure = out[out.index("the verdict's figure"):]
    assert "not the verdict" in figure and "geometric mean" in figure, figure
    runs = [ln for ln in figure.splitlines() if "tok/s (runs " in ln]
    assert [ln.split(":")[0].strip() for ln in runs] == [A, B] and all(ln.count(",") == 1 for ln in runs), runs
    assert f"gain {rec['gain']:+.1%}; noise band {rec['band']:.1%}" in figure and "at least --min-band 90%" in figure
    assert "within the noise or better: kept" in figure
