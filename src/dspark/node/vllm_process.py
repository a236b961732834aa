"""The vLLM child process: start it, copy its log (noting the stage each line announces), stop it.

vLLM runs in its own process group (its engine core and TP workers inherit it), without the
notify protocol's variables. Every end of a run, whatever ends it, sweeps that whole group
with `end_group`, the one routine for it: a stop (SIGTERM, grace, SIGKILL), vLLM exiting on
its own (seen by `poll`; its engine and workers would live on with parent 1, holding the
ports), the next start, the supervisor's exit.

A supervisor killed with SIGKILL (outside systemd, where no KillMode= sweeps the cgroup)
cannot sweep. For that, a small reaper process joins vLLM's group and blocks on a pipe only
the supervisor holds: when the supervisor dies the pipe closes and the reaper SIGKILLs the
group (itself included), so vLLM, its engine and its workers go at once and clients get
errors, not hangs. vLLM's API process also gets SIGKILL as its parent-death signal."""

from __future__ import annotations

import ctypes
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TextIO

from dspark.engine.log import ShutdownLog
from dspark.node.launch import Launch
from dspark.node.notify import child_env
from dspark.node.stages import next_stage

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
PARENT_DEATH_SIGNAL = signal.SIGKILL  # a SIGTERM starts vLLM's graceful shutdown, which waits on clients
GROUP_GONE_S = 15.0  # how long end_group waits for the group's last process to be gone

# Run as `python -c REAPER` in vLLM's process group; stdin is the pipe only the supervisor holds.
# A stop's SIGTERM is for vLLM: ignored here; the sweep's SIGKILL ends the reaper with the rest.
# With nothing else left in its group (vLLM's run ended without a sweep: no supervisor loop,
# as in a test), it has nothing to guard and exits.
REAPER = """
import os, select, signal
signal.signal(signal.SIGTERM, signal.SIG_IGN)
signal.signal(signal.SIGINT, signal.SIG_IGN)
me, group = os.getpid(), os.getpgrp()
def others():
    for n in os.listdir("/proc"):
        if n.isdigit() and int(n) != me:
            try:
                with open("/proc/%s/stat" % n, "rb") as f:
                    x = f.read().rsplit(b")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if x[0] != b"Z" and int(x[2]) == group:
                return True
    return False
while True:
    if select.select([0], [], [], 2.0)[0]:
        try:
            if os.read(0, 64):
                continue
        except OSError:
            pass
        break
    if not others():
        raise SystemExit(0)
os.killpg(0, signal.SIGKILL)
"""

_VERSION_RE = re.compile(r"\(v(\d[^)\s]*)\)|version (\d+\.\d+\.\d+\S*)")


# ------------------------------------------------------------------ log lines
def version_in(line: str) -> str | None:
    if "vLLM" in line or "version" in line:
        m = _VERSION_RE.search(line)
        if m:
            return m.group(1) or m.group(2)
    return None


# ------------------------------------------------------------------ the process
def _parent_death_signal() -> None:  # runs in the child between fork and exec
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, int(PARENT_DEATH_SIGNAL), 0, 0, 0)
    if os.getppid() == 1:  # the supervisor died before prctl: go at once
        os.kill(os.getpid(), PARENT_DEATH_SIGNAL)


class VllmProcess:
    """One vLLM run. `start` must be called from the thread that lives as long as the
    supervisor (the parent-death signal follows the thread that forked)."""

    def __init__(self, launch: Launch, env: dict[str, str], *, api_key: str | None = None,
                 out: TextIO | None = None):
        self.launch = launch
        self.env = env
        self.api_key = api_key
        self.out = out
        self.proc: subprocess.Popen | None = None
        self.reaper: subprocess.Popen | None = None
        self._reaper_pipe: int | None = None  # the write end: closed by the sweep, or by our death
        self._swept = False
        self.stage = "starting"
        self.version: str | None = None
        self.log_filter = ShutdownLog()  # per run: vLLM's abort traceback on a requested stop, one line

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def start(self) -> None:
        self.stop(0.0)  # a previous run's group, should anything of it remain: swept before the next
        env = child_env(self.env)
        inherited = env.get("PYTHONPATH")
        env.update(self.launch.env)
        if inherited and "PYTHONPATH" in self.launch.env:
            # The launch's path (dspark's API guard first) ahead of the one this process was given.
            env["PYTHONPATH"] = os.pathsep.join([self.launch.env["PYTHONPATH"], inherited])
        if self.api_key:
            env["VLLM_API_KEY"] = self.api_key
        env.setdefault("PYTHONUNBUFFERED", "1")
        # vLLM's rank-0 GPU worker posts usage statistics to its maintainers' server at start
        # and every 10 minutes (vllm/usage/usage_lib.py) unless told not to: a node serves
        # without reaching out. The cluster file's env can still set it to 0.
        env.setdefault("VLLM_NO_USAGE_STATS", "1")
        self.proc = subprocess.Popen(
            self.launch.argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, process_group=0, bufsize=1, text=True, errors="replace",
            preexec_fn=_parent_death_signal,
        )
        self._swept = False
        r, self._reaper_pipe = os.pipe()  # both ends close-on-exec: vLLM inherits neither
        try:  # in vLLM's group (the same session: setpgid allows it); its stdin is our pipe's read end
            self.reaper = subprocess.Popen([sys.executable, "-I", "-c", REAPER], stdin=r,
                                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                           process_group=self.proc.pid)
        except OSError:  # vLLM already gone (its group with it): poll() sees the exit
            self.reaper = None
        finally:
            os.close(r)
        self.log_filter = ShutdownLog()
        threading.Thread(target=self._pump, args=(self.proc.stdout, self.log_filter), name="vllm-log",
                         daemon=True).start()

    def _pump(self, stream: Iterable[str], log_filter: ShutdownLog) -> None:
        """Copy vLLM's log to ours (the journal) and note the stage each line announces."""
        out = self.out or sys.stdout
        for line in stream:
            for kept in log_filter.feed(line):
                out.write(kept)
            out.flush()
            self.stage = next_stage(line, self.stage)
            if self.version is None:
                self.version = version_in(line)
        for kept in log_filter.flush():
            out.write(kept)
        out.flush()

    def poll(self) -> int | None:
        """vLLM's exit code once it has exited, and then its group swept (once): its engine and
        workers do not outlive it."""
        if self.proc is None:
            return None
        rc = self.proc.poll()
        if rc is not None and not self._swept:
            self._sweep()
        return rc

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def drain(self) -> None:
        """SIGTERM to vLLM's API process alone: its own shutdown stops the engine core (drained
        when vLLM runs with --shutdown-timeout) and the TP workers in order. Its exit, seen by
        `poll`, is swept as any other."""
        if self.proc is not None and not self._swept and self.proc.poll() is None:
            try:
                os.kill(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

    def stop(self, grace_s: float, on_stopping: Callable[[int], None] | None = None) -> bool:
        """SIGTERM vLLM's process group, then SIGKILL after `grace_s`; always sweep the group.
        Returns True when vLLM had to be killed."""
        proc = self.proc
        killed = False
        if proc is None or self._swept:
            return killed
        if proc.poll() is None:
            if on_stopping is not None:
                on_stopping(proc.pid)
            signal_group(proc.pid, signal.SIGTERM)
            signal_group(proc.pid, signal.SIGCONT)  # a stopped (hung) vLLM must see the SIGTERM
            deadline = time.monotonic() + grace_s
            while proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)
            killed = proc.poll() is None
        # Children of a pair whose peer died can outlive the leader: always sweep the group.
        self._sweep()
        return killed

    def _sweep(self) -> None:
        proc, reaper = self.proc, self.reaper
        assert proc is not None  # called by poll() and stop() only, once they have seen a started process
        self._swept = True
        end_group(proc.pid, [p for p in (proc, reaper) if p is not None])
        if self._reaper_pipe is not None:
            os.close(self._reaper_pipe)
            self._reaper_pipe = None


def group_members(pgid: int, proc: str = "/proc") -> list[int]:
    """The live (not zombie) processes of process group `pgid`."""
    out: list[int] = []
    try:
        entries = os.listdir(proc)
    except OSError:
        return out
    for name in entries:
        if not name.isdigit():
            continue
        try:
            with open(f"{proc}/{name}/stat", "rb") as f:
                fields = f.read(4096).rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 2 and fields[0] != b"Z" and int(fields[2]) == pgid:
            out.append(int(name))
    return out


def end_group(pgid: int, children: Sequence[subprocess.Popen] = (), gone_s: float = GROUP_GONE_S) -> list[int]:
    """SIGKILL every process of group `pgid`, reap our `children` of it, and wait (up to
    `gone_s`) until none is left, so that its ports and memory are free. The one sweep of a
    vLLM run; returns what is still there after `gone_s` (nothing, unless a process is stuck
    in the kernel)."""
    signal_group(pgid, signal.SIGKILL)
    deadline = time.monotonic() + gone_s
    for child in children:
        try:
            child.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    left = group_members(pgid)
    while left and time.monotonic() < deadline:
        signal_group(pgid, signal.SIGKILL)
        time.sleep(0.05)
        left = group_members(pgid)
    return left


def signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
