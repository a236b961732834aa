"""The vLLM child process: start it, copy its log (noting the stage each line announces), stop it.

vLLM runs in its own process group, without the notify protocol's variables, with a
parent-death signal: if the supervisor itself dies without stopping it (SIGKILL outside
systemd, where no KillMode= sweeps the cgroup), the kernel sends vLLM SIGTERM, the signal a
clean stop starts with, and vLLM stops its engine and workers its own way."""

from __future__ import annotations

import ctypes
import os
import re
import signal
import subprocess
import sys
import threading
import time
from typing import Callable, TextIO

from . import vllm_facts
from .notify import child_env
from .render import Launch

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
PARENT_DEATH_SIGNAL = signal.SIGTERM

_VERSION_RE = re.compile(r"\(v(\d[^)\s]*)\)|version (\d+\.\d+\.\d+\S*)")


# ------------------------------------------------------------------ log lines -> stages
def later(stage: str, current: str) -> bool:
    order = vllm_facts.STAGE_ORDER
    return order.index(stage) > order.index(current) if current in order else False


def at_least(stage: str, floor: str) -> bool:
    order = vllm_facts.STAGE_ORDER
    return stage in order and order.index(stage) >= order.index(floor)


def stage_detail(stage: str) -> str:
    return {
        "rendezvous": "vLLM is in the rendezvous",
        "loading": "loading the model",
        "warming": "warming up (profiling, compiling, capturing graphs)",
    }.get(stage, "")


def next_stage(line: str, current: str) -> str:
    """The stage after reading `line` (stages only move forward)."""
    for marker, stage in vllm_facts.LOG_STAGES:
        if marker in line and later(stage, current):
            current = stage
    return current


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
        self.stage = "starting"
        self.version: str | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def start(self) -> None:
        env = child_env(self.env)
        env.update(self.launch.env)
        if self.api_key:
            env["VLLM_API_KEY"] = self.api_key
        env.setdefault("PYTHONUNBUFFERED", "1")
        self.proc = subprocess.Popen(
            self.launch.argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, start_new_session=True, bufsize=1, text=True, errors="replace",
            preexec_fn=_parent_death_signal,
        )
        threading.Thread(target=self._pump, args=(self.proc.stdout,), name="vllm-log", daemon=True).start()

    def _pump(self, stream) -> None:
        """Copy vLLM's log to ours (the journal) and note the stage each line announces."""
        out = self.out or sys.stdout
        for line in stream:
            out.write(line)
            out.flush()
            self.stage = next_stage(line, self.stage)
            if self.version is None:
                self.version = version_in(line)

    def poll(self) -> int | None:
        return self.proc.poll() if self.proc is not None else None

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, grace_s: float, on_stopping: Callable[[int], None] | None = None) -> bool:
        """SIGTERM vLLM's process group, then SIGKILL after `grace_s`; always sweep the group.
        Returns True when vLLM had to be killed."""
        proc = self.proc
        killed = False
        if proc is None:
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
        signal_group(proc.pid, signal.SIGKILL)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        return killed


def signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
