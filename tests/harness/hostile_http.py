"""Answers that attack an HTTP client below the JSON: a decompression bomb (issue 33, item 5)
and an answer whose status line and headers come a byte at a time (item 6), for tests'
HostileServer routes. Both are built here, in well under a second: no binary is committed."""

from __future__ import annotations

import struct
import threading
import time
import zlib
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

from tests.harness.hostile import Handler, HostileServer, send

TRICKLE_EVERY_S = 0.5
TRICKLE_FOR_S = 30.0  # a trickling handler's own bound (before the fix, how long a caller waited)
TRICKLE_HEAD = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n"
                b"Connection: close\r\n\r\n{}")


def gzip_of_zeros(n_mib: int) -> bytes:
    """gzip of `n_mib` MiB of zeros, without compressing them all: after a full flush the
    compressor forgets its history, so every further MiB compresses to the same bytes."""
    mib = bytes(1 << 20)
    c = zlib.compressobj(9, zlib.DEFLATED, -15)
    first = c.compress(mib) + c.flush(zlib.Z_FULL_FLUSH)
    again = c.compress(mib) + c.flush(zlib.Z_FULL_FLUSH)
    tail = c.flush(zlib.Z_FINISH)
    crc = 0
    for _ in range(n_mib):
        crc = zlib.crc32(mib, crc)
    header = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff"
    return header + first + again * (n_mib - 1) + tail + struct.pack("<II", crc, (n_mib << 20) & 0xFFFFFFFF)


def gzip_of(data: bytes) -> bytes:
    c = zlib.compressobj(9, zlib.DEFLATED, 31)
    return c.compress(data) + c.flush()


def inflate(gz: bytes) -> tuple[int, bool]:
    """What one gzip layer inflates to (its size, read in 1 MiB steps, and whether it ended:
    zlib checks the CRC and length there), and whether all of it is zeros."""
    d = zlib.decompressobj(31)
    out, total, zeros = d.decompress(gz, 1 << 20), 0, True
    while out:
        total, zeros = total + len(out), zeros and not out.strip(b"\0")
        out = d.decompress(d.unconsumed_tail, 1 << 20)
    assert d.eof, "the gzip member did not end"
    return total, zeros


def gzip_gzip_bomb(n_mib: int) -> bytes:
    """`Content-Encoding: gzip, gzip`: a few KB on the wire, `n_mib` MiB of zeros once decoded."""
    return gzip_of(gzip_of_zeros(n_mib))


def bomb_handler(body: bytes, encoding: str = "gzip, gzip") -> Handler:
    def fn(h) -> None:
        h.close_connection = True  # the client leaves without reading it: no next request to wait for
        send(h, 200, body, headers={"Content-Encoding": encoding})
    return fn


def trickle_handler(stop: threading.Event, threads: list[threading.Thread]) -> Handler:
    """The status line and headers one byte every TRICKLE_EVERY_S, for at most TRICKLE_FOR_S or
    until `stop`; each handler's thread is put in `threads` (for the caller to join)."""
    def fn(h) -> None:
        threads.append(threading.current_thread())
        h.close_connection = True
        t_end = time.monotonic() + TRICKLE_FOR_S
        for i in range(len(TRICKLE_HEAD)):
            if stop.is_set() or time.monotonic() > t_end:
                break
            h.wfile.write(TRICKLE_HEAD[i:i + 1])
            stop.wait(TRICKLE_EVERY_S)
    return fn


@contextmanager
def hostile(attack: str, bomb: bytes, paths: tuple[str, ...], hosts: tuple[str, ...] = ("127.0.0.1",),
            ports: tuple[int, ...] | None = None) -> Iterator[list[HostileServer]]:
    """One loopback server per host (on `ports`, else free ones), answering every path with the
    attack ("bomb" or "trickle"); every trickling handler has ended when the block is left."""
    stop, threads = threading.Event(), []
    handler = bomb_handler(bomb) if attack == "bomb" else trickle_handler(stop, threads)
    try:
        with ExitStack() as stack:
            yield [stack.enter_context(HostileServer(dict.fromkeys(paths, handler), host=h,
                                                     port=ports[i] if ports else 0))
                   for i, h in enumerate(hosts)]
            stop.set()
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=5)
        assert not any(t.is_alive() for t in threads)
