"""Stopping the local appliance: `local down` (SIGTERM to the `local up` holding the directory,
or to the supervisors a killed one left behind) and the bounds a planned stop keeps.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

from dspark.config import validate as C
from dspark.config.schema import ConfigError, SupervisorConfig
from dspark.local.cluster import LocalError, Progress
from dspark.local.lock import holder, left_behind, lock_path

STOP_GRACE_S = 40.0  # Pair.stop after a fault: every supervisor's time to exit (SIGTERM, then SIGKILL)
# A planned stop's bound beyond the head's drain_s + stop_grace_s: its sweep, its 1.5 s STOPPED
# linger, a worker's poll that sees it (1 s) and that worker's own stop (its vLLM killed at once).
STOP_MARGIN_S = 10.0


def planned_stop_s(sup: SupervisorConfig) -> float:
    """The longest a planned stop takes, kept by Pair.stop: the head's drain (drain_s), vLLM's
    time to exit after it (stop_grace_s; then the head kills it), and STOP_MARGIN_S for the
    supervisors' own exit, the workers stopping once their head shows STOPPED."""
    return sup.drain_s + sup.stop_grace_s + STOP_MARGIN_S


def stop_bound_s(workdir: Path) -> float:
    """The longest a planned stop of the appliance in `workdir` takes (planned_stop_s), from its
    cluster file (the defaults' when unreadable), and 5 s for `local up` to release its lock."""
    try:
        sup = C.load(workdir / "cluster.toml").supervisor
    except ConfigError:
        sup = SupervisorConfig()
    return planned_stop_s(sup) + 5


def _is_dspark(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"dspark" in f.read(1 << 16)
    except OSError:
        return False


def down(workdir: Path, timeout_s: float | None = None, progress: Progress = print) -> float:
    """Stop the appliance running from `workdir`: SIGTERM to the PID in its lock (the Ctrl-C of
    `local up`: the head first, then every node), then wait up to `timeout_s` (default: its
    stop's bound) for the lock to be released. Returns the seconds it took; LocalError when
    nothing runs there or it outlasts the wait."""
    h = holder(workdir)
    path = lock_path(workdir)
    if not h.running:
        last = f"; the last one there (PID {h.stale}) ended without a clean stop" if h.stale else ""
        behind = left_behind(workdir)
        if not behind:
            raise LocalError(f"nothing runs from {workdir}: no local appliance holds {path}{last}")
        return _stop_left_behind(workdir, behind, timeout_s, progress, last)
    if h.pid is None:
        raise LocalError(f"{path} is held, but no PID is written in it; nothing signalled")
    if not _is_dspark(h.pid):
        raise LocalError(f"{path} is held, and names PID {h.pid}, which is not a dspark process; nothing signalled")
    bound = stop_bound_s(workdir) if timeout_s is None else timeout_s
    t0 = time.monotonic()
    try:
        os.kill(h.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass  # it ended meanwhile: its lock says when it is gone
    progress(f"stopping the local appliance in {workdir} (PID {h.pid}): SIGTERM sent, as Ctrl-C would; "
             f"waiting up to {bound:g} s (the head drains first, then every node stops)")
    took = _wait_stopped(lambda: not holder(workdir).running, t0, bound)
    if took is not None:
        progress(f"stopped after {took:.1f} s; its logs are in {workdir.resolve() / 'logs'}")
        return took
    raise LocalError(f"the local appliance (PID {h.pid}) still runs {bound:g} s after SIGTERM: its nodes are still "
                     f"stopping (see {workdir.resolve() / 'logs'}); run local down again to wait longer")


def _wait_stopped(stopped: Callable[[], bool], t0: float, bound: float) -> float | None:
    """Seconds from `t0` until `stopped()` holds (polled every 0.2 s); None once `bound` passed."""
    while time.monotonic() - t0 < bound:
        if stopped():
            return time.monotonic() - t0
        time.sleep(0.2)
    return None


def _stop_left_behind(workdir: Path, pids: list[int], timeout_s: float | None, progress: Progress,
                      last: str) -> float:
    """SIGTERM every supervisor a killed `local up` left running from `workdir` (each stops its
    vLLM, a head after its drain), and wait for every one to end."""
    bound = stop_bound_s(workdir) if timeout_s is None else timeout_s
    t0 = time.monotonic()
    progress(f"no local appliance holds {lock_path(workdir)}{last}, but its supervisors {', '.join(map(str, pids))} "
             f"still run from {workdir}: SIGTERM sent to each; waiting up to {bound:g} s")
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    took = _wait_stopped(lambda: not left_behind(workdir), t0, bound)
    if took is not None:
        progress(f"stopped after {took:.1f} s; their logs are in {workdir.resolve() / 'logs'}")
        return took
    raise LocalError(f"supervisors {', '.join(map(str, left_behind(workdir)))} still run from {workdir} {bound:g} s "
                     "after SIGTERM; run local down again to wait longer")

