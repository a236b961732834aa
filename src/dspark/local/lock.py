"""What one `local up` holds on this machine: its directory (a flock-held lock file with its PID
inside; `holder` tells who holds it, `left_behind` the supervisors a killed `local up` left
running from it) and its ports (`check_ports_free`).
"""

from __future__ import annotations

import fcntl
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from dspark.local.cluster import (
    DEFAULT_NODES,
    HEAD_ADDR,
    LocalError,
    LocalPorts,
    Progress,
    node_address,
    node_name,
)
from dspark.status import cli_command

# The directory's lock: flock-held by `local up` for the appliance's whole life, its PID inside.
# One appliance per directory: a second `local up` there is refused (it would rewrite the running
# pair's cluster file, rotate its logs and delete its state); `local down` signals that PID.
LOCK_NAME = "local.lock"
LOCK_RETRY_S = 1.0  # a `local down`/`local status` probe holds the lock for an instant: waited out


def check_ports_free(ports: LocalPorts, nodes: int = DEFAULT_NODES) -> None:
    wanted = [(HEAD_ADDR, ports.api, "API"), (HEAD_ADDR, ports.master, "rendezvous"),
              (HEAD_ADDR, ports.agent, "head agent")]
    wanted += [(node_address(r), ports.agent, f"{node_name(r)} agent") for r in range(1, nodes)]
    for host, port, what in wanted:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError as e:
                raise LocalError(f"{what} port {host}:{port} is not free ({e.strerror}); "
                                 f"is another local appliance running? choose other ports (--api-port, --agent-port, "
                                 f"--master-port)") from None


def lock_path(workdir: Path) -> Path:
    return workdir.resolve() / LOCK_NAME


def _pid_in(fd: int) -> int | None:
    """The PID written in an open lock file, or None (empty: released cleanly, or not yet written)."""
    try:
        text = os.pread(fd, 64, 0).decode("ascii", "replace").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() and int(text) > 0 else None


@dataclass
class DirLock:
    """The directory held by this process (`local up`) until release()."""

    path: Path
    fd: int

    def release(self) -> None:
        """Empty the file (a clean stop leaves no PID for the next `local up` to call stale), then
        let the lock go. The file stays: removing it would let two processes lock two files."""
        if self.fd < 0:
            return
        try:
            os.ftruncate(self.fd, 0)
        except OSError:
            pass
        os.close(self.fd)
        self.fd = -1


def take_dir(workdir: Path, progress: Progress = print) -> DirLock:
    """Hold `workdir` for this process's appliance, before anything in it is written: refused,
    naming the PID, while another appliance holds it; a lock left by one that died (the kernel
    released its flock, its PID is still written) is taken over, and `progress` says so."""
    path = lock_path(workdir)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as e:
        raise LocalError(f"cannot lock {path}: {e.strerror}") from None
    deadline = time.monotonic() + LOCK_RETRY_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() < deadline:
                time.sleep(0.1)
                continue
            pid = _pid_in(fd)
            os.close(fd)
            who = f"PID {pid}" if pid else "a PID not written yet: it is starting"
            raise LocalError(f"{workdir} is in use: another local appliance ({who}) runs from it and holds {path}; "
                             f"stop it first ({cli_command()} local down --dir {workdir}) or give another --dir"
                             ) from None
        except OSError as e:
            os.close(fd)
            raise LocalError(f"cannot lock {path}: {e.strerror}") from None
    old = _pid_in(fd)
    behind = left_behind(workdir)
    if behind:  # its `local up` was killed outright: its supervisors (own sessions) still serve from here
        os.close(fd)  # its PID stays written
        raise LocalError(f"{workdir} is in use: the supervisors {', '.join(map(str, behind))} still run from it, left "
                         f"behind by the appliance that held it{f' (PID {old})' if old else ''}; stop them first "
                         f"({cli_command()} local down --dir {workdir})")
    if old is not None and old != os.getpid():
        progress(f"taking over {path}: the appliance that held it (PID {old}) ended without releasing it")
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return DirLock(path, fd)


@dataclass(frozen=True)
class Holder:
    """Who holds a directory's lock: `pid` (None: not written yet) while `running`; else the PID a
    dead appliance left written (`stale`), if any."""

    running: bool
    pid: int | None = None
    stale: int | None = None


def holder(workdir: Path) -> Holder:
    """Whether a local appliance runs from `workdir` (its lock is held), and its PID."""
    try:
        fd = os.open(lock_path(workdir), os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return Holder(False)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = _pid_in(fd)
            deadline = time.monotonic() + 2.0  # between its flock and its write: an instant
            while pid is None and time.monotonic() < deadline:
                time.sleep(0.1)
                pid = _pid_in(fd)
            return Holder(True, pid)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return Holder(False, stale=_pid_in(fd))
    finally:
        os.close(fd)


def left_behind(workdir: Path) -> list[int]:
    """The PIDs of `dspark serve` supervisors running from `workdir`'s cluster file (what `local
    up` starts, each in a session of its own, so they outlive a `local up` killed outright)."""
    target = str(workdir.resolve() / "cluster.toml").encode()
    out = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read(1 << 16).split(b"\0")
        except OSError:
            continue
        if b"serve" in argv and target in argv and any(b"dspark" in a for a in argv):
            out.append(int(entry))
    return sorted(out)

