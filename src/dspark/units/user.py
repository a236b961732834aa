"""Who the units' service runs as, and what that user may read and execute: `dspark check` asks it
of the model directory and the runtime, `dspark systemd install` of what the units start."""

from __future__ import annotations

import os
import pwd
import stat
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ServiceUser:
    name: str
    uid: int
    gids: frozenset[int]
    why: str  # how it was chosen, for the line


def service_user(unit_user: str, under_unit: bool) -> ServiceUser:
    """Who reads the model: this process's user when it runs as the unit (or when the units'
    user does not exist here: `dspark local`, a development machine); else the units' user."""
    me = pwd.getpwuid(os.getuid()).pw_name if _has_uid(os.getuid()) else str(os.getuid())
    if not under_unit:
        try:
            pw = pwd.getpwnam(unit_user)
            return ServiceUser(pw.pw_name, pw.pw_uid, frozenset(os.getgrouplist(pw.pw_name, pw.pw_gid)),
                               "the units' user")
        except KeyError:
            pass
    return ServiceUser(me, os.getuid(), frozenset(os.getgroups()) | {os.getgid()},
                       "this process's user" + ("" if under_unit else f"; there is no {unit_user!r} user here"))


def _has_uid(uid: int) -> bool:
    try:
        pwd.getpwuid(uid)
        return True
    except KeyError:
        return False


def readable_by(path: Path, user: ServiceUser) -> str | None:
    """Why `user` cannot read `path` (a file, or list a directory) by its mode bits and those of
    every directory above it, or None. ACLs and the units' sandbox are not modelled."""
    return _denied(path, user, execute=False)


def executable_by(path: Path, user: ServiceUser) -> str | None:
    """Why `user` cannot execute `path` (read and execute it: a script is read by its
    interpreter) by the mode bits of it and every directory above it, or None."""
    return _denied(path, user, execute=True)


def _denied(path: Path, user: ServiceUser, execute: bool) -> str | None:
    if user.uid == 0:
        return None
    path = Path(os.path.abspath(path))
    chain = [*reversed(path.parents), path]
    for i, p in enumerate(chain):
        try:
            st = p.stat()
        except OSError as e:
            return f"{p}: {e.strerror}"
        last = i == len(chain) - 1
        if not last:
            need = stat.S_IXOTH
        elif execute or stat.S_ISDIR(st.st_mode):
            need = stat.S_IROTH | stat.S_IXOTH
        else:
            need = stat.S_IROTH
        if st.st_uid == user.uid:
            bits = (st.st_mode >> 6) & 7
        elif st.st_gid in user.gids:
            bits = (st.st_mode >> 3) & 7
        else:
            bits = st.st_mode & 7
        if bits & need != need:
            what = ("execute" if execute else "read") if last else "enter"
            return f"{p} (mode {stat.filemode(st.st_mode)}, owner uid {st.st_uid}) does not let {user.name} {what} it"
    return None
