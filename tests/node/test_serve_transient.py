"""A start refused for a condition that can clear is retried, never exit 2 (issue 33, items 4
and 11). `dspark serve` as the units run it, a real process with a real notify socket and the
stand-in vLLM (tests.harness.standin): a port another process holds is waited for with a growing delay
and the node starts once it frees; one held for good ends, after the bounded wait, in exit 5,
which `Restart=on-failure` restarts (only 2 is in RestartPreventExitStatus=). A state directory
that is full (a tiny tmpfs) or read-only (a read-only bind mount) is said by path and
filesystem, exit 5 as well."""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import subprocess
import time
import tomllib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from dspark.config import validate as C
from dspark.config.template import dumps
from dspark.lines import state as line_state
from dspark.local.model import TINY_MODEL
from dspark.node.policy import EXIT_CONFIG
from tests.harness.standin import write_cluster

EXIT_RETRY = 5  # dspark.node.policy.EXIT_RETRY: restarted by the units


def checked_cluster(tmp_path: Path) -> Path:
    """The stand-in's cluster file, with what `dspark check` reads to pass (serve --check)."""
    path = write_cluster(tmp_path)
    (tmp_path / "model" / "config.json").write_text(json.dumps(TINY_MODEL))
    data = tomllib.loads(path.read_text())
    data["serving"]["load_format"] = "dummy"  # no shards: the stand-in loads nothing
    path.write_text(dumps(data))
    return path


def hold(port: int) -> socket.socket:
    """A listening socket of this test process on 127.0.0.1:port (the 'other user')."""
    s = socket.socket()
    s.bind(("127.0.0.1", port))
    s.listen(1)
    return s


def read_until(s, text: str, timeout: float = 90) -> None:
    """Serve.read(until=...), ending as soon as the process has exited (with its output)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s.read(timeout=0.5)
        if any(text in m for m in s.messages):
            return
        if s.proc.poll() is not None:
            break
    raise AssertionError(f"no {text!r} (exit {s.proc.poll()}); got {s.messages}\n{output(s)[-3000:]}")


def output(s) -> str:
    if s.proc.poll() is None:
        s.proc.kill()
        s.proc.wait(timeout=30)
    return s.proc.stdout.read()


def statuses(s) -> list[str]:
    return [m for m in s.messages if "STATUS=" in m]


# ------------------------------------------------------------------------------ ports
def test_a_port_held_at_start_is_retried_and_the_node_starts_once_it_frees(tmp_path, serve):
    path = checked_cluster(tmp_path)
    agent = C.load(path).head.agent_port
    held = hold(agent)
    try:
        s = serve(path, "h", "--check")  # as the units run it
        read_until(s, "retrying in")  # the wait says so in systemctl status
    finally:
        held.close()
    read_until(s, "READY=1")
    assert s.proc.poll() is None and s.state()["state"] == "serving"
    waiting = [m for m in statuses(s) if "retrying in" in m]
    assert f"127.0.0.1:{agent} is held by pid {os.getpid()}" in waiting[0], waiting
    assert any("EXTEND_TIMEOUT_USEC=" in m for m in s.messages)  # the start timeout kept ahead
    out = output(s)
    assert "port.agent" in out and "retrying in 1 s" in out and "Traceback" not in out, out[-3000:]


def test_a_port_held_for_good_ends_in_a_restartable_exit_after_a_bounded_wait(tmp_path, serve):
    path = checked_cluster(tmp_path)
    agent = C.load(path).head.agent_port
    held = hold(agent)
    try:
        s = serve(path, "h", "--check", "--transient-wait", "4")
        rc = s.proc.wait(timeout=120)
    finally:
        held.close()
    out = output(s)
    assert rc == EXIT_RETRY != EXIT_CONFIG, out[-3000:]
    last = out.strip().splitlines()[-1]  # the last journal line, what `systemctl status` shows
    assert f"127.0.0.1:{agent} is still held by pid {os.getpid()}" in last, last
    assert "after 4 s" in last and "exit 5" in last and "fix:" in last, last
    assert out.count("retrying in") >= 2 and "starting vLLM" not in out and "Traceback" not in out, out[-3000:]


def test_a_stop_while_waiting_for_a_port_ends_at_once_with_exit_0(tmp_path, serve):
    path = checked_cluster(tmp_path)
    held = hold(C.load(path).head.agent_port)
    try:
        s = serve(path, "h", "--check")
        read_until(s, "retrying in")
        t0 = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        rc = s.proc.wait(timeout=60)
    finally:
        held.close()
    assert rc == 0 and time.monotonic() - t0 < 30, output(s)[-3000:]


def test_the_agent_port_taken_after_the_check_is_restartable_too(tmp_path, serve):
    """Without --check (or taken between the check and the agent's bind): serve's own bind
    fails with EADDRINUSE, which was exit 2."""
    path = write_cluster(tmp_path)
    agent = C.load(path).head.agent_port
    held = hold(agent)
    try:
        s = serve(path, "h", "--transient-wait", "2")
        rc = s.proc.wait(timeout=120)
    finally:
        held.close()
    out = output(s)
    assert rc == EXIT_RETRY, out[-3000:]
    last = out.strip().splitlines()[-1]
    assert f"cannot bind the agent's port 127.0.0.1:{agent}" in last and f"pid {os.getpid()}" in last, last
    assert "Traceback" not in out


class FakeTime:
    """The gate's clock and wait: each wait moves the clock, nothing sleeps."""

    def __init__(self, on_wait=None):
        self.now, self.waits, self.on_wait = 1000.0, [], on_wait

    def clock(self) -> float:
        return self.now

    def wait(self, seconds: float) -> int | None:
        self.waits.append(seconds)
        self.now += seconds
        if self.on_wait:
            self.on_wait(len(self.waits))
        return None


def _gate(path: Path, t: FakeTime, wait_s: float, lines: list[str]):
    from dspark.preflight import Host, gate

    c = C.load(path)
    return gate(c, c.head, lines.append, Host(peers=False, starting=True, identity={}), port_wait_s=wait_s,
                wait=t.wait, waiting=lambda _s, line: lines.append(line), clock=t.clock)


def test_the_wait_grows_1_2_4_to_30_s_and_is_bounded(tmp_path):
    path = checked_cluster(tmp_path)
    held, lines = hold(C.load(path).head.agent_port), []
    try:
        t = FakeTime()
        v = _gate(path, t, 100, lines)
    finally:
        held.close()
    assert t.waits == [1, 2, 4, 8, 16, 30, 30, 9], t.waits  # 100 s in all, then the refusal
    assert v.retry and v.refusal.startswith("refusing to start for now: after 100 s, port.agent: "), v
    assert sum("retrying in" in line for line in lines) == 8, lines


def test_a_port_that_frees_during_the_wait_starts_the_node(tmp_path):
    path = checked_cluster(tmp_path)
    held, lines = hold(C.load(path).head.agent_port), []
    try:
        t = FakeTime(on_wait=lambda n: held.close() if n == 3 else None)
        v = _gate(path, t, 100, lines)
    finally:
        held.close()
    assert (v.refusal, v.retry, t.waits) == (None, False, [1, 2, 4]), (v, t.waits)
    assert lines[-1].endswith("port.agent: free now"), lines[-3:]


def test_a_failed_check_besides_the_port_is_refused_at_once_with_exit_2(tmp_path):
    path = checked_cluster(tmp_path)
    (tmp_path / "model" / "config.json").unlink()  # model.dir fails too: not something a wait clears
    held, lines = hold(C.load(path).head.agent_port), []
    try:
        t = FakeTime()
        v = _gate(path, t, 100, lines)
    finally:
        held.close()
    assert t.waits == [] and not v.retry and "model.dir" in v.refusal and "port.agent" in v.refusal, v


# ------------------------------------------------------------------------------ full or read-only
def _mount(*args: str) -> None:
    r = subprocess.run(["mount", *args], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount here (needs root and CAP_SYS_ADMIN): {r.stderr.strip()}")


def _umount(where: Path) -> None:
    if subprocess.run(["umount", str(where)], capture_output=True).returncode != 0:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


@contextmanager
def tiny_tmpfs(where: Path) -> Iterator[Path]:
    """`where` (created) as a 64 KiB tmpfs for the block, unmounted after; a skip where mounting
    is not allowed."""
    where.mkdir(exist_ok=True)
    _mount("-t", "tmpfs", "-o", "size=64k", "tmpfs", str(where))
    try:
        yield where
    finally:
        _umount(where)


def fill(directory: Path) -> None:
    """Fill the filesystem of `directory`: its next write is ENOSPC."""
    fd = os.open(directory / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        for _ in range(10_000):
            try:
                os.write(fd, b"\0" * 4096)
            except OSError as e:
                assert e.errno == errno.ENOSPC
                return
    finally:
        os.close(fd)


def _retired_line_state(state: Path) -> None:
    """A state naming the retired v0.29.0: serve falls back to the file's line and writes that
    down, the write the full or read-only directory refuses (tests/switch/test_switch_notify.py)."""
    line_state.write(state, line_state.LineState("v0.29.0", "v0.28.0"))


def _serve_to_its_end(tmp_path: Path, serve) -> tuple[int, str]:
    """The head served from tmp_path's state directory, with a 2 s transient wait: its exit code
    and its output."""
    s = serve(write_cluster(tmp_path), "h", "--transient-wait", "2")
    try:
        rc = s.proc.wait(timeout=120)
    finally:
        out = output(s)
    return rc, out


def test_a_full_state_directory_says_what_is_full_and_stays_restartable(tmp_path, serve):
    with tiny_tmpfs(tmp_path / "state-h") as state:
        _retired_line_state(state)
        fill(state)
        rc, out = _serve_to_its_end(tmp_path, serve)
    assert rc == EXIT_RETRY, out[-3000:]
    last = out.strip().splitlines()[-1]
    assert "No space left on device" in last and str(state) in last, last
    assert "tmpfs" in last and "free" in last and "exit 5" in last, last
    assert "Traceback" not in out


def test_a_read_only_state_directory_is_named_with_its_mount_and_stays_restartable(tmp_path, serve):
    state, src = tmp_path / "state-h", tmp_path / "state-src"
    state.mkdir()
    src.mkdir()
    _retired_line_state(src)
    _mount("--bind", str(src), str(state))
    try:
        _mount("-o", "remount,bind,ro", str(state))
        rc, out = _serve_to_its_end(tmp_path, serve)
    finally:
        _umount(state)
    assert rc == EXIT_RETRY, out[-3000:]
    last = out.strip().splitlines()[-1]
    assert "Read-only file system" in last and str(state) in last and "mounted read-only" in last, last
    assert "exit 5" in last and "Traceback" not in out


# ------------------------------------------------------------------------------ the mapping itself
@pytest.mark.parametrize("code,retry", [(errno.ENOSPC, True), (errno.EDQUOT, True), (errno.EROFS, True),
                                        (errno.EADDRINUSE, True), (errno.EIO, True), (errno.EMFILE, True),
                                        (errno.ENOENT, False), (errno.EACCES, False), (errno.ENOEXEC, False)])
def test_which_os_errors_are_retried(tmp_path, code, retry):
    """The CLI's boundary (the narrowest one every OSError of serve() crosses): only an error
    the cluster file or the install must fix is a refusal (2); every other is retried (5)."""
    from dspark.cli.main import _serve_os_error
    from dspark.config.validate import load

    cluster = load(write_cluster(tmp_path))
    message, transient = _serve_os_error(OSError(code, os.strerror(code)), cluster, cluster.head, tmp_path)
    assert transient is retry, message
    assert message.startswith("serve: ") and os.strerror(code) in message, message
