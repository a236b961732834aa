"""Every state file dspark keeps in a node's state directory, written and read back through the
functions that own it (dspark.lines.state, dspark.node.supervisor's failure history and start count,
dspark.switch's history and lock), with the faults of issue 33:

- items 17 and 1: each write fsyncs the file and its directory, leaves no temp file when it
  fails, makes a 0600 file owned by the state directory's owner (the `dspark` user) when root
  writes it, and follows no symlink the service user planted (at the file's name, at a temp
  file's name, at the switch's lock or its reports' directory);
- items 12, 15 and 16: a corrupt file (not JSON, the wrong shape, too deep, a counter out of
  range, entries that are not switch records) never crashes its reader; it is moved aside to
  `<name>.corrupt-<UTC time>`, never overwritten, said in one line, and the default goes on.

The hostile files under a running `dspark serve` are in test_state_files_hostile.py."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from dspark import switch as W
from dspark.lines import history as H
from dspark.lines import state as line_state
from dspark.node.policy import backoff_delay
from dspark.node.supervisor import FAILURES_FILE, FailureHistory, _count_start, _read_starts
from tests.lines.test_line_state import cluster

A, B = "v0.28.0", "v0.32.0"
OWNER = 54321  # a uid and gid no account has: the state directory's owner, as `dspark` is on a node
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (chown to another user, as `sudo dspark switch`)")


def record(id: str = "s1", **kw) -> H.Record:
    return H.Record(id=id, started_at=1.0, from_line=A, to_line=B, verdict="kept", reason="ok", serving_on=B, **kw)


# Each state file's writer, as its owner calls it, and the file it writes.
WRITERS = {
    "runtime-line.json": lambda d: line_state.write(d, line_state.LineState(B, A)),
    FAILURES_FILE: lambda d: FailureHistory(d).save(3, "exit 4: liveness lost"),
    "starts": _count_start,
    H.HISTORY: lambda d: H.save(d, record()),
}
# The temp names the writers used before (a fixed name, or the writer's PID): predictable, so
# the service user could plant a link there.
OLD_TEMP_NAMES = {"runtime-line.json": f".runtime-line.json.{os.getpid()}.tmp", FAILURES_FILE: "failures.json.tmp",
                  "starts": ".starts.tmp", H.HISTORY: f".{H.HISTORY}.tmp"}


def asides(d: Path, name: str) -> list[Path]:
    return sorted(d.glob(f"{name}.corrupt-*"))


@pytest.fixture
def owned_dir():
    """A state directory owned by OWNER, in a directory OWNER can reach (pytest's tmp_path is
    root's 0700), with a root-owned victim file and directory beside it; removed afterwards."""
    base = Path(tempfile.mkdtemp(prefix="dspark-state-io-"))
    try:
        os.chmod(base, 0o711)
        state = base / "state"
        state.mkdir()
        os.chown(state, OWNER, OWNER)
        victim = base / "victim"
        victim.write_text("root's file\n")
        (base / "victim-dir").mkdir()
        yield state
    finally:
        shutil.rmtree(base, ignore_errors=True)


# ------------------------------------------------------------------ item 17: fsync, no temp left
@pytest.mark.parametrize("name", sorted(WRITERS))
def test_each_state_write_fsyncs_the_file_and_then_its_directory(tmp_path, monkeypatch, name):
    synced: list[str] = []
    real = os.fsync

    def counting(fd):
        synced.append("dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file")
        return real(fd)

    monkeypatch.setattr(os, "fsync", counting)
    WRITERS[name](tmp_path)
    assert (tmp_path / name).is_file()
    assert "file" in synced and "dir" in synced and synced.index("file") < synced.index("dir"), synced


@pytest.mark.parametrize("name", sorted(WRITERS))
def test_a_write_that_fails_leaves_the_old_file_whole_and_no_temp_file(tmp_path, monkeypatch, name):
    WRITERS[name](tmp_path)
    before = (tmp_path / name).read_bytes()

    def no_space(*a, **kw):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", no_space)
    monkeypatch.setattr(os, "rename", no_space)
    try:
        WRITERS[name](tmp_path)
    except OSError:
        pass  # the callers that must go on (the supervisor's) swallow it; the others raise it
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]
    assert (tmp_path / name).read_bytes() == before


def test_temp_files_a_killed_writer_left_are_swept_by_the_next_write(tmp_path):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a PID whose process is gone
    old = tmp_path / f".runtime-line.json.{gone.pid}-0123abcd.tmp"
    recent = tmp_path / f".runtime-line.json.{gone.pid}-4567abcd.tmp"
    alive = tmp_path / f".runtime-line.json.{os.getpid()}-89abcdef.tmp"
    for p in (old, recent, alive):
        p.write_text("")
    os.utime(old, (time.time() - 3600,) * 2)
    os.utime(alive, (time.time() - 3600,) * 2)
    line_state.write(tmp_path, line_state.LineState(B, A))
    # the dead writer's old file is gone; a recent one (a write under way elsewhere) and a live writer's stay
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([recent.name, alive.name, line_state.FILE])


# ------------------------------------------------------------------ item 1: ownership, mode, links
@as_root
@pytest.mark.parametrize("name", sorted(WRITERS))
def test_root_writes_0600_files_owned_by_the_state_dirs_owner(owned_dir, name):
    WRITERS[name](owned_dir)
    st = os.lstat(owned_dir / name)
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (OWNER, OWNER, 0o600)


@as_root
@pytest.mark.parametrize("name", sorted(WRITERS))
@pytest.mark.parametrize("at", ["file", "temp"])
def test_a_symlink_planted_in_the_state_dir_is_never_followed(owned_dir, name, at):
    victim = owned_dir.parent / "victim"
    link = owned_dir / (name if at == "file" else OLD_TEMP_NAMES[name])
    link.symlink_to(victim)
    os.lchown(link, OWNER, OWNER)
    try:
        WRITERS[name](owned_dir)
    except OSError as e:
        assert "symbolic link" in str(e), e  # a refusal says why
    assert victim.read_text() == "root's file\n"
    assert stat.S_IMODE(victim.stat().st_mode) == 0o644 and victim.stat().st_uid == 0


def switcher(state_dir: Path) -> W.Switcher:
    """The real Switcher.run (its lock, its privileges) around a switch that does nothing."""
    s = W.Switcher(cluster(), state_dir, B, progress=lambda m: None)
    s.check = lambda: A  # type: ignore[method-assign]  (the pair's agents are not asked)
    s._run = lambda current: record()  # type: ignore[method-assign]
    return s


@as_root
def test_the_switch_lock_follows_no_link_and_truncates_nothing(owned_dir):
    victim = owned_dir.parent / "victim"
    (owned_dir / H.LOCK).symlink_to(victim)
    with pytest.raises(W.SwitchRefused, match="symbolic link"):
        switcher(owned_dir).run()
    assert victim.read_text() == "root's file\n"
    (owned_dir / H.LOCK).unlink()
    assert switcher(owned_dir).run().id == "s1"
    st = os.lstat(owned_dir / H.LOCK)
    assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (OWNER, 0o600)


def test_a_fifo_at_the_switch_lock_is_refused_at_once(tmp_path):
    os.mkfifo(tmp_path / H.LOCK)
    out: list = []

    def run():
        try:
            out.append(switcher(tmp_path).run())
        except Exception as e:  # noqa: BLE001 (the test reads it below)
            out.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(10)
    if t.is_alive():  # blocked opening the FIFO for writing: a reader lets it go
        fd = os.open(tmp_path / H.LOCK, os.O_RDONLY | os.O_NONBLOCK)
        t.join(10)
        os.close(fd)
        pytest.fail("the switch blocked on a FIFO at its lock")
    assert isinstance(out[0], W.SwitchRefused) and "FIFO" in str(out[0]), out


# The switch's reports, written by dspark.bench (Report.save) under switches/<id>/: run as the
# state directory's owner, a link at switches/ reaches nothing root owns. In a process of its
# own: the switch changes its effective uid while it runs.
SWITCH_REPORTS = """
import os, sys, time
from pathlib import Path
from dspark import switch as W
from dspark.lines import history as H
from dspark.bench import decode
from tests.lines.test_line_state import cluster, report

state = Path(sys.argv[1])
s = W.Switcher(cluster(), state, "v0.32.0", bench=W.Bench(), progress=lambda m: None)
s.check = lambda: "v0.28.0"

def fake_decode(target, spec, on_update=None, settings=None):
    r = report(10, 40)
    on_update(r)
    return r

decode.run = fake_decode

def one_bench(current):
    rec = H.Record(id="t1", started_at=time.time(), from_line=current, to_line=s.to)
    s._bench("v0.28.0-before-1", rec)
    rec.verdict = "not started"
    return s._finish(rec)

s._run = one_bench
try:
    print("done", s.run().verdict)
except (OSError, W.SwitchRefused) as e:
    print("refused", e)
print("euid", os.geteuid())
"""


def run_switch_reports(state: Path) -> str:
    r = subprocess.run([sys.executable, "-c", SWITCH_REPORTS, str(state)], capture_output=True, text=True,
                       timeout=120, cwd=Path(__file__).resolve().parents[2])  # the repository: `tests` imports
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stdout + r.stderr
    assert r.stdout.strip().endswith("euid 0"), r.stdout  # root again once the switch is over
    return r.stdout


@as_root
def test_the_switch_writes_its_reports_as_the_state_dirs_owner_and_follows_no_link(owned_dir):
    victim_dir = owned_dir.parent / "victim-dir"
    (owned_dir / W.REPORTS).symlink_to(victim_dir)
    os.lchown(owned_dir / W.REPORTS, OWNER, OWNER)
    out = run_switch_reports(owned_dir)
    assert list(victim_dir.iterdir()) == [], out  # nothing written where the link led
    (owned_dir / W.REPORTS).unlink()
    out = run_switch_reports(owned_dir)
    assert "done not started" in out, out
    written = [p for p in (owned_dir / W.REPORTS).rglob("*")] + [owned_dir / H.HISTORY]
    assert {os.lstat(p).st_uid for p in written} == {OWNER}, [(p, os.lstat(p).st_uid) for p in written]


# ------------------------------------------------------------------ items 15, 16: the switch history
CORRUPT_HISTORY = {
    "not JSON": b'[{"id": "s0", "verdict": "ke',
    "empty (a power loss before fsync)": b"",
    "not a list": b'{"id": "s0"}\n',
    "nested too deeply": b"[" * 100_000 + b"]" * 100_000,
    "larger than its cap": b"[" + b"0," * (9 << 20) + b"0]",
}


@pytest.mark.parametrize("kind", sorted(CORRUPT_HISTORY))
def test_a_corrupt_history_is_moved_aside_never_replaced(tmp_path, capfd, kind):
    body = CORRUPT_HISTORY[kind]
    (tmp_path / H.HISTORY).write_bytes(body)
    assert H.read(tmp_path) == []
    H.save(tmp_path, record("s1"))  # what the next switch's _finish does
    kept = asides(tmp_path, H.HISTORY)
    assert len(kept) == 1 and kept[0].read_bytes() == body, kept
    assert [h["id"] for h in H.read(tmp_path)] == ["s1"]
    said = [ln for ln in capfd.readouterr().err.splitlines() if H.HISTORY in ln]
    assert len(said) == 1 and "moved aside" in said[0] and kept[0].name in said[0], said


def test_a_second_corrupt_history_never_overwrites_the_first_set_aside(tmp_path):
    for body in (b"first", b"second", b"third"):  # within one second: the same UTC timestamp
        (tmp_path / H.HISTORY).write_bytes(body)
        assert H.read(tmp_path) == []
    assert sorted(p.read_bytes() for p in asides(tmp_path, H.HISTORY)) == [b"first", b"second", b"third"]


def test_entries_that_are_not_switch_records_neither_crash_nor_lose_the_next_record(tmp_path, capfd):
    good = dataclasses.asdict(record("s0"))
    body = json.dumps([good, 42, "x", None, {"id": "s9", "started_at": "x", "from_line": 1, "band": "wide"}])
    (tmp_path / H.HISTORY).write_text(body)
    assert [h["id"] for h in H.read(tmp_path)] == ["s0"]
    assert "kept" in H.table(H.read(tmp_path))  # the table of what is left: no crash
    H.save(tmp_path, record("s1"))
    assert [h["id"] for h in H.read(tmp_path)] == ["s0", "s1"]  # the good one kept, the new one added
    kept = asides(tmp_path, H.HISTORY)
    assert len(kept) == 1 and kept[0].read_text() == body  # the file as it was, whole
    assert "4 entries" in capfd.readouterr().err


# ------------------------------------------------------------------ items 12, 13: the node's own files
def test_a_failure_count_out_of_range_is_clamped_and_never_crashes_the_backoff(tmp_path):
    f = tmp_path / FAILURES_FILE
    for n in (1026, 5000, 10**400):
        f.write_text(json.dumps({"consecutive": n, "last": "x"}))
        count, last = FailureHistory(tmp_path).load()
        assert 0 < count <= 1025 and last == "x", count
        assert backoff_delay(count) == backoff_delay(1025)  # BACKOFF_MAX_S, no OverflowError
    FailureHistory(tmp_path).save(10**6, "x")
    assert json.loads(f.read_text())["consecutive"] <= 1025
    f.write_text(json.dumps({"consecutive": -3}))
    assert FailureHistory(tmp_path).load()[0] == 0
    assert asides(tmp_path, FAILURES_FILE) == []  # a count, only out of range: clamped where it is


@pytest.mark.parametrize("body", ['{"consecutive": 1e999}', '{"consecutive": "many"}', '{"consecutive": true}',
                                  "[1, 2]", '{"consecutive": 2, "last": {"a": 1}}', "{", "[" * 100_000])
def test_a_failure_history_of_the_wrong_shape_is_moved_aside(tmp_path, capfd, body):
    (tmp_path / FAILURES_FILE).write_text(body)
    assert FailureHistory(tmp_path).load() == (0, "")
    assert [p.read_text() for p in asides(tmp_path, FAILURES_FILE)] == [body]
    err = capfd.readouterr().err
    assert err.count("moved aside") == 1 and FAILURES_FILE in err, err


@pytest.mark.parametrize("body", ["abc\n", "-4\n", "", "1e9\n", "9" * 5000])
def test_a_start_count_that_is_not_one_is_moved_aside_and_counting_starts_over(tmp_path, body):
    (tmp_path / "starts").write_text(body)
    assert _count_start(tmp_path) == 0
    assert (tmp_path / "starts").read_text() == "1\n"
    assert [p.read_text() for p in asides(tmp_path, "starts")] == [body]


def test_a_huge_start_count_is_clamped(tmp_path):
    (tmp_path / "starts").write_text("9" * 40 + "\n")
    assert 0 < _read_starts(tmp_path) <= 10**9
    assert 0 < _count_start(tmp_path) <= 10**9 and int((tmp_path / "starts").read_text()) <= 10**9


@pytest.mark.parametrize("body", ["[" * 100_000, "[1]", '{"line": 3, "file_line": "v0.28.0"}', '{"line": ""}',
                                  '{"line": "v0.32.0", "file_line": "v0.28.0", "switch": {"id": "x"}}',
                                  '{"line": "v0.32.0", "file_line": "v0.28.0", "switch": {"id": "x", "from": "a", '
                                  '"to": "b", "at": 1' + "0" * 400 + '}}'])
def test_a_line_state_of_the_wrong_shape_is_moved_aside_and_the_files_line_holds(tmp_path, capfd, body):
    (tmp_path / line_state.FILE).write_text(body)
    assert line_state.current(tmp_path, A) == line_state.LineState(A, A)
    assert [p.read_text() for p in asides(tmp_path, line_state.FILE)] == [body]
    assert line_state.current(tmp_path, A) == line_state.LineState(A, A)  # said once: the file is gone
    err = capfd.readouterr().err
    assert err.count("moved aside") == 1 and "runtime line" in err, err
