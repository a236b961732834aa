"""The one way dspark writes a file of a node's state directory, and the one way it reads one back.

The state directory belongs to the service user (`dspark`, the units' StateDirectory=), and
root writes into it too (`sudo dspark switch`). Its files are runtime-line.json
(dspark.lines.state), failures.json and starts (dspark.node.supervisor), switch-history.json and
.switch.lock (dspark.switch). Each is:

- written whole or not at all (`write_atomic`): a temp file of an unpredictable name, created
  with O_EXCL|O_NOFOLLOW, mode 0600, and owned by the directory's owner when root writes it;
  fsynced, renamed over the file (refused where the file's name is a symbolic link), and the
  directory fsynced, so that a power loss leaves the old file or the new one, never an empty
  one; the temp file removed when any step fails;
- read back bounded and typed (`read_state`): opened without following a link or blocking on a
  FIFO, up to a size cap, then checked by the caller's parser. A file that is not what its kind
  holds (a link, a FIFO, a device, too large, not JSON, nested too deeply, the wrong shape) is
  moved aside to `<name>.corrupt-<UTC time>` (never over an earlier one), said in one line, and
  the caller goes on with its default: kept for whoever looks into it, never replaced unseen.

Only names inside the directory are guarded: the directory's own path is the operator's (a
unit's StateDirectory=, `--state-dir`), which the service user cannot replace.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import secrets
import stat
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import BinaryIO, TypeVar

from dspark import log as L
from dspark.files.safe_read import (
    FileTooLarge,
    NotRegularFile,
    open_regular,
    read_at_most,
    require_regular,
)

MODE = 0o600
MAX_STATE_BYTES = 64 * 1024  # runtime-line.json and failures.json hold a few hundred bytes
STATE_JSON_DEPTH = 16         # runtime-line.json nests 2 levels, the switch history 3
STALE_TEMP_S = 60.0           # a temp file this old, of a process that is gone, was left by a killed writer

T = TypeVar("T")


class CorruptState(ValueError):
    """A state file whose content is not what its kind holds: a parser's refusal, with the reason."""


def json_kind(value: object) -> str:
    """What a JSON value is, for a refusal's message."""
    if isinstance(value, bool):
        return "true or false"
    return {dict: "an object", list: "a list", str: "a text", type(None): "null"}.get(type(value), "a number")


# ------------------------------------------------------------------ writing
def _open_dir(directory: Path) -> int:
    return os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)


def _sync_dir(dfd: int) -> None:
    try:
        os.fsync(dfd)
    except OSError as e:
        if e.errno != errno.EINVAL:  # a filesystem that cannot sync a directory: nothing more to do
            raise


def _own_like_dir(fd: int, dfd: int) -> None:
    """Root writing in a directory another user owns: the new file is that user's, as if it had
    written it (the service reads and replaces its own files)."""
    if os.geteuid() == 0:
        d = os.fstat(dfd)
        if d.st_uid != 0:
            os.fchown(fd, d.st_uid, d.st_gid)


@contextmanager
def _naming(path: Path) -> Iterator[None]:
    """An OSError of the block names `path` (not a temp file's name, relative to a directory fd)."""
    try:
        yield
    except OSError as e:
        if not e.filename or not os.path.isabs(str(e.filename)):
            e.filename = str(path)
        raise


def write_atomic(path: str | os.PathLike, data: bytes | str, *, mode: int | None = MODE) -> None:
    """`path` holds `data`, durably, or (on an OSError) is as it was, with no temp file left.

    A state file (the default) is 0600 and owned by the directory's owner. `mode=None` writes any
    other file dspark writes whole (a unit file, a bench report, the local model's files): its mode
    is what the umask leaves of 0666 and its owner the writer, as a plain write would make it."""
    path = Path(path)
    with _naming(path):
        _write_atomic(path, data.encode() if isinstance(data, str) else data, mode)


def _temp_name(name: str) -> str:
    return f".{name}.{os.getpid()}-{secrets.token_hex(4)}.tmp"


def _sweep(name: str, dfd: int) -> None:
    """Temp files of `name` that a writer killed mid-write (kill -9, a power loss) left: its
    process gone and the file older than any write takes."""
    pattern = re.compile(rf"\.{re.escape(name)}\.(\d+)-[0-9a-f]{{8}}\.tmp")
    for entry in os.listdir(dfd):
        m = pattern.fullmatch(entry)
        if m is None or _alive(int(m.group(1))):
            continue
        with suppress(OSError):
            if time.time() - os.stat(entry, dir_fd=dfd, follow_symlinks=False).st_mtime > STALE_TEMP_S:
                os.unlink(entry, dir_fd=dfd)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # another user's process
    return True


def _write_atomic(path: Path, body: bytes, mode: int | None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    dfd = _open_dir(path.parent)
    try:
        _sweep(path.name, dfd)
        tmp = _temp_name(path.name)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(tmp, flags, 0o666 if mode is None else mode, dir_fd=dfd)
        try:
            try:
                if mode is not None:
                    os.fchmod(fd, mode)  # whatever the umask
                if mode == MODE:
                    _own_like_dir(fd, dfd)  # a state file stays the directory owner's, root writing or not
                view = memoryview(body)
                while view:
                    view = view[os.write(fd, view):]
                os.fsync(fd)
            finally:
                os.close(fd)
            st = _lstat(path.name, dfd)
            if st is not None and stat.S_ISLNK(st.st_mode):
                raise OSError(errno.ELOOP, "a symbolic link where a state file belongs: not replaced", str(path))
            os.replace(tmp, path.name, src_dir_fd=dfd, dst_dir_fd=dfd)
        except BaseException:
            with suppress(OSError):
                os.unlink(tmp, dir_fd=dfd)
            raise
        _sync_dir(dfd)
    finally:
        os.close(dfd)


def open_lock(path: str | os.PathLike) -> BinaryIO:
    """A lock file opened for flock(2): created 0600 (its directory owner's, when root creates
    it), never truncated, never opened through a link, never blocking on a FIFO. NotRegularFile
    (an OSError) for a link or anything but a regular file at its name."""
    path = Path(path)
    with _naming(path):
        return _open_lock(path)


def _open_lock(path: Path) -> BinaryIO:
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    dfd = _open_dir(path.parent)
    try:
        created = True
        try:
            fd = os.open(path.name, flags | os.O_CREAT | os.O_EXCL, MODE, dir_fd=dfd)
        except FileExistsError:
            created = False
            try:
                fd = os.open(path.name, flags, dir_fd=dfd)
            except OSError as e:
                if e.errno == errno.ELOOP:
                    raise NotRegularFile(errno.ELOOP, "a symbolic link, not followed", str(path)) from None
                raise
        try:
            require_regular(fd, path)
            if created:
                os.fchmod(fd, MODE)
                _own_like_dir(fd, dfd)
            return os.fdopen(fd, "r+b", buffering=0)
        except BaseException:
            os.close(fd)
            raise
    finally:
        os.close(dfd)


@contextmanager
def as_owner_of(directory: str | os.PathLike, adopt: tuple[str, ...] = ()) -> Iterator[None]:
    """Root acts as `directory`'s owner inside the block (effective uid and gid, no supplementary
    groups), so that whatever it writes there, through any path and any module (dspark.bench's
    reports included), reaches only what that user could reach itself, and is that user's.
    `adopt`: subdirectories that root made there before (an earlier root switch's `switches/`),
    handed to the owner first so that it can write in them. Anyone but root runs the block as
    it is, as does root in a directory of its own."""
    if os.geteuid() != 0:
        yield
        return
    dfd = _open_dir(Path(directory))
    try:
        owner = os.fstat(dfd)
        if owner.st_uid != 0:
            for name in adopt:
                _adopt(name, dfd, owner)
    finally:
        os.close(dfd)
    if owner.st_uid == 0:
        yield
        return
    groups, egid = os.getgroups(), os.getegid()
    os.setgroups([])
    os.setegid(owner.st_gid)
    os.seteuid(owner.st_uid)
    try:
        yield
    finally:
        os.seteuid(0)
        os.setegid(egid)
        os.setgroups(groups)


def _adopt(name: str, dfd: int, owner: os.stat_result) -> None:
    try:  # opened, not looked up by name: a link or a file swapped in is never the one chowned
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
    except OSError:
        return  # absent, or not a directory: the block's writes refuse it on their own
    try:
        if os.fstat(fd).st_uid == 0:
            os.fchown(fd, owner.st_uid, owner.st_gid)
    finally:
        os.close(fd)


# ------------------------------------------------------------------ reading
def _lstat(name: str, dfd: int) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def _say(text: str) -> None:
    L.line(logging.WARNING, f"dspark: {text}")


def read_state(path: str | os.PathLike, parse: Callable[[bytes], T], default: T, *, default_is: str,
               max_bytes: int = MAX_STATE_BYTES) -> T:
    """`parse` of the file's bytes; `default` when there is no file. A file that is not what its
    kind holds (`parse` raises a ValueError: CorruptState, JSONRefused, ...) is moved aside
    (`set_aside`); one that cannot be read (permissions, I/O) stays where it is. Both are said
    in one line that ends with `default_is`, what the caller goes on with."""
    path = Path(path)
    try:
        with open_regular(path, follow_symlinks=False) as f:
            seen = os.fstat(f.fileno())
            data = read_at_most(f, max_bytes + 1)
        if len(data) > max_bytes:
            raise FileTooLarge(errno.EFBIG, f"larger than {max_bytes:,} bytes", str(path))
    except FileNotFoundError:
        return default
    except (NotRegularFile, FileTooLarge) as e:
        set_aside(path, e.strerror or str(e), default_is)
        return default
    except OSError as e:
        _say(f"{path}: cannot be read ({e.strerror or e}); going on with {default_is}")
        return default
    try:
        return parse(data)
    except ValueError as e:
        set_aside(path, str(e), default_is, same_as=seen)
        return default


def set_aside(path: Path, why: str, default_is: str, *, keep: bool = False,
              same_as: os.stat_result | None = None) -> Path | None:
    """`move_aside`, said in one line; where it cannot be moved (a directory the caller may not
    write), said so. The name it was moved to, or None."""
    try:
        aside = move_aside(path, keep=keep, same_as=same_as)
    except OSError as e:
        _say(f"{path}: {why}; not moved aside ({e.strerror or e}); going on with {default_is}")
        return None
    if aside is not None:
        _say(f"{path}: {why}; {'kept' if keep else 'moved aside'} as {aside.name}; going on with {default_is}")
    return aside


def move_aside(path: Path, *, keep: bool = False, same_as: os.stat_result | None = None) -> Path | None:
    """`path` renamed to `<name>.corrupt-<UTC time>` (`-2`, `-3`, ... where that name is taken:
    an earlier file set aside is never overwritten). `keep`: a second name for it, the file
    staying where it is (it is about to be replaced). `same_as`: only if `path` is still that
    file (a writer that replaced it meanwhile wrote a good one). None when there was nothing."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    name = path.name
    dfd = _open_dir(path.parent)
    try:
        st = _lstat(name, dfd)
        if st is None or (same_as is not None and (st.st_dev, st.st_ino) != (same_as.st_dev, same_as.st_ino)):
            return None
        for i in range(1, 1000):
            aside = f"{name}.corrupt-{stamp}" + (f"-{i}" if i > 1 else "")
            try:  # link(2) never replaces a name: the first free one wins, even against another process
                os.link(name, aside, src_dir_fd=dfd, dst_dir_fd=dfd, follow_symlinks=False)
            except FileExistsError:
                continue
            except OSError as e:
                if e.errno not in (errno.EPERM, errno.EMLINK, errno.EOPNOTSUPP, errno.ENOTSUP):
                    raise
                # No hard link here (a directory; a filesystem without them): renamed where nothing is.
                if _lstat(aside, dfd) is not None:
                    continue
                os.rename(name, aside, src_dir_fd=dfd, dst_dir_fd=dfd)
            else:
                if not keep:
                    os.unlink(name, dir_fd=dfd)
            _sync_dir(dfd)
            return path.with_name(aside)
        raise OSError(errno.EEXIST, "a thousand files already set aside this second", str(path))
    finally:
        os.close(dfd)


__all__ = ["CorruptState", "MAX_STATE_BYTES", "MODE", "STATE_JSON_DEPTH", "as_owner_of", "json_kind", "move_aside",
           "open_lock", "read_state", "set_aside", "write_atomic"]
