"""Who listens on a TCP port of this host, read from /proc: the sockets in LISTEN state in
/proc/net/tcp and tcp6, and the processes whose fds hold them. The supervisor asks it before it
sends vLLM's API key to the API port: a process of another user that took the port first would
otherwise receive the key with every probe (issue 33, item 3)."""

from __future__ import annotations

import os
import pwd
from pathlib import Path

LISTEN = "0A"  # the kernel's TCP_LISTEN, as /proc/net/tcp writes a socket's state
MAX_NET_BYTES = 8 << 20  # /proc/net/tcp of a busy host: a line (150 bytes) a socket


def listening_inodes(port: int, proc: Path = Path("/proc")) -> set[int]:
    """Inodes of the sockets listening on `port` (any address, IPv4 or IPv6)."""
    out: set[int] = set()
    for name in ("tcp", "tcp6"):
        try:
            with open(proc / "net" / name, "rb") as f:
                text = f.read(MAX_NET_BYTES).decode("ascii", "replace")
        except OSError:
            continue
        for line in text.splitlines()[1:]:
            fields = line.split()
            if len(fields) < 10 or fields[3] != LISTEN:
                continue
            try:
                if int(fields[1].rsplit(":", 1)[1], 16) == port:
                    out.add(int(fields[9]))
            except (IndexError, ValueError):
                continue
    return out


def _socket_inodes(pid: int, proc: Path) -> set[int] | None:
    """The socket inodes among `pid`'s fds; None when they cannot be read (another user's process
    without the right to look, or gone)."""
    try:
        fds = os.listdir(proc / str(pid) / "fd")
    except OSError:
        return None
    out = set()
    for fd in fds:
        try:
            target = os.readlink(proc / str(pid) / "fd" / fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            try:
                out.add(int(target[8:-1]))
            except ValueError:
                continue
    return out


def _pids(proc: Path) -> list[int]:
    try:
        return [int(n) for n in os.listdir(proc) if n.isdigit()]
    except OSError:
        return []


def _pgid(pid: int, proc: Path) -> int | None:
    try:
        with open(proc / str(pid) / "stat", "rb") as f:
            return int(f.read(4096).rsplit(b")", 1)[1].split()[2])
    except (OSError, IndexError, ValueError):
        return None


def describe(pid: int, proc: Path = Path("/proc")) -> str:
    """`PID 123 (user bob: python3 -m http.server)`, with what of it can be read."""
    try:
        uid = os.stat(proc / str(pid)).st_uid
        try:
            user = pwd.getpwuid(uid).pw_name
        except KeyError:
            user = str(uid)
    except OSError:
        user = "?"
    try:
        with open(proc / str(pid) / "cmdline", "rb") as f:
            cmd = f.read(4096).replace(b"\0", b" ").decode("utf-8", "replace").strip()
    except OSError:
        cmd = ""
    return f"PID {pid} (user {user}{': ' + cmd[:120] if cmd else ''})"


def foreign_listener(port: int, group: int, proc: Path = Path("/proc")) -> str | None:
    """None when nothing listens on `port` or every listening socket is held by a process of
    process group `group` (vLLM's: the supervisor starts it as a group leader); else who holds
    it, in words."""
    inodes = listening_inodes(port, proc)
    if not inodes:
        return None
    ours: set[int] = set()
    members = [group] + [p for p in _pids(proc) if p != group and _pgid(p, proc) == group]
    for pid in members:  # the group first: its leader is vLLM's API server
        ours |= _socket_inodes(pid, proc) or set()
        if inodes <= ours:
            return None
    for pid in _pids(proc):  # someone else's: name them if this user may look
        held = _socket_inodes(pid, proc)
        if held and held & (inodes - ours):
            return f"port {port} is held by {describe(pid, proc)}, not by dspark's vLLM"
    return f"port {port} is held by a process this user cannot see (another user's), not by dspark's vLLM"
