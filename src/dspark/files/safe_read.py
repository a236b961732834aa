"""The one way dspark reads a file it did not write, and a JSON text it did not write.

Every such file (the cluster file, the model's config.json and index, each safetensors
header, the API key and token files, the bench reports, a node's state files through
dspark.files.state_io) is opened here:

- without blocking (O_NONBLOCK), then refused unless it is a regular file: a FIFO would hang
  the reader, a link to /dev/zero or /dev/urandom would grow it without end;
- and read only up to a size cap, stated by the caller for that kind of file.

A refusal is an OSError (NotRegularFile, FileTooLarge) with a one-line message, so callers
that already turn an unreadable file into a clear error keep doing so. `parse_json` bounds a
JSON text's size and nesting the same way, for files and for a peer's answers (dspark.net.http).
"""

from __future__ import annotations

import errno
import json
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, BinaryIO

MAX_JSON_DEPTH = 64  # an agent's /state nests 4 levels, a model's config.json fewer than 10
MAX_MODEL_CONFIG_BYTES = 4 * 1024 * 1024   # a model's config.json is a few KiB
MAX_MODEL_INDEX_BYTES = 64 * 1024 * 1024   # the largest published safetensors indexes are a few MiB
MAX_SECRET_BYTES = 64 * 1024               # an API key or a token file


class NotRegularFile(OSError):
    """A directory, FIFO, socket or device where a regular file was expected."""


class FileTooLarge(OSError):
    """A file larger than its kind's cap."""


class JSONRefused(ValueError):
    """A JSON text refused by `parse_json`: not JSON, too large or nested too deeply."""


def require_regular(fd: int, path: str | os.PathLike) -> None:
    """NotRegularFile unless the open `fd` (of `path`) is a regular file: a FIFO, a device, a
    directory or a socket is refused before a byte is read."""
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        raise NotRegularFile(errno.EINVAL, f"not a regular file ({file_kind(mode)})", str(path))


@contextmanager
def open_regular(path: str | os.PathLike, *, follow_symlinks: bool = True) -> Iterator[BinaryIO]:
    """`path` opened for reading without blocking; NotRegularFile unless it is a regular file
    (nor a symbolic link, with `follow_symlinks=False`: a state file, in a directory another
    user writes, dspark.files.state_io)."""
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0) | (0 if follow_symlinks else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except OSError as e:
        if e.errno == errno.ELOOP and not follow_symlinks:
            raise NotRegularFile(errno.ELOOP, "a symbolic link, not followed", str(path)) from None
        raise
    try:
        require_regular(fd, path)
        f = os.fdopen(fd, "rb", buffering=0)
    except BaseException:
        os.close(fd)
        raise
    with f:
        yield f


def file_kind(mode: int) -> str:
    """What a file that is not a regular one is, from its st_mode."""
    return ("a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode)
            else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
            else "a symbolic link" if stat.S_ISLNK(mode) else "a socket or special file")


def read_at_most(f: BinaryIO, n: int) -> bytes:
    """Up to `n` bytes of `f` (fewer only at its end), in bounded chunks."""
    out = bytearray()
    while len(out) < n:
        chunk = f.read(min(1 << 20, n - len(out)))
        if not chunk:
            break
        out += chunk
    return bytes(out)


def read_bytes(path: str | os.PathLike, max_bytes: int) -> bytes:
    """The whole of a regular file of at most `max_bytes`; FileTooLarge past it."""
    with open_regular(path) as f:
        data = read_at_most(f, max_bytes + 1)
    if len(data) > max_bytes:
        raise FileTooLarge(errno.EFBIG, f"larger than {_size(max_bytes)}", str(path))
    return data


def read_text(path: str | os.PathLike, max_bytes: int) -> str:
    """read_bytes as UTF-8 text (UnicodeDecodeError, a ValueError, when it is not)."""
    return read_bytes(path, max_bytes).decode("utf-8")


def _depth_over(value: Any, limit: int) -> bool:
    """True when `value` nests more than `limit` levels (iterative: no recursion to exhaust)."""
    todo = [(value, 1)]
    while todo:
        v, d = todo.pop()
        if isinstance(v, dict):
            v = v.values()
        elif not isinstance(v, list):
            continue
        if d > limit:
            return True
        todo.extend((x, d + 1) for x in v if isinstance(x, (dict, list)))
    return False


def parse_json(text: bytes | str, *, max_bytes: int, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """The JSON value of `text`, at most `max_bytes` long and `max_depth` levels deep; anything
    else raises JSONRefused (a ValueError), whatever the text holds."""
    if len(text) > max_bytes:
        raise JSONRefused(f"JSON larger than {_size(max_bytes)}")
    try:
        value = json.loads(text)
    except RecursionError:
        raise JSONRefused(f"JSON nested more than {max_depth} levels deep") from None
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
        raise JSONRefused(f"not JSON ({e})") from None
    if _depth_over(value, max_depth):
        raise JSONRefused(f"JSON nested more than {max_depth} levels deep")
    return value


def read_json(path: str | os.PathLike, max_bytes: int, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """A regular file's JSON value, within read_bytes' and parse_json's bounds."""
    return parse_json(read_bytes(path, max_bytes), max_bytes=max_bytes, max_depth=max_depth)


def _size(n: int) -> str:
    return f"{n // (1 << 20)} MiB" if n >= 1 << 20 and n % (1 << 20) == 0 else (
        f"{n // 1024} KiB" if n >= 1024 and n % 1024 == 0 else f"{n:,} bytes")


def describe(e: OSError, path: str | os.PathLike | None = None) -> str:
    """One line for an OSError from this module (or any): the path and why."""
    where = e.filename or (str(path) if path is not None else "")
    why = e.strerror or str(e)
    return f"{where}: {why}" if where else why


__all__ = ["FileTooLarge", "JSONRefused", "MAX_JSON_DEPTH", "NotRegularFile", "describe", "file_kind", "open_regular",
           "parse_json", "read_at_most", "read_bytes", "read_json", "read_text"]
