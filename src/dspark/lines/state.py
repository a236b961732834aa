"""Which runtime line a node runs: appliance state kept in the node's state directory.

The cluster file names the pair's line (`serving.runtime_line`); `dspark switch` moves a running
pair to another installed line (`serving.line_commands`) without editing that file, so the line
a node runs is state, the same on every node of a pair:

    <state dir>/runtime-line.json   {"line": "v0.32.0", "file_line": "v0.28.0",
                                     "switch": {"id": ..., "from": ..., "to": ..., "at": ...,
                                                "rollback": false, "owner_pid": ...,
                                                "owner_start": ...} | null}

`file_line` is the cluster file's line when the state was written: a cluster file that names
another line since (a new deployment, a NixOS generation) supersedes the state. `switch` is set
while a switch (or its rollback) is under way and cleared once the pair serves the line and the
verdict is in; its owner (the `dspark switch` process: PID and start time) is named so that
a record whose switch was killed is recognised and finished (dspark.lines.history). The head's
file is written by `dspark switch`; a worker writes its own when it follows its head onto a line
(dspark.node.policy), so that a worker restarted alone comes back on the pair's line.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from dspark.files import state_io
from dspark.files.safe_read import parse_json

FILE = "runtime-line.json"


@dataclass(frozen=True)
class Switch:
    id: str
    from_line: str
    to_line: str
    at: float
    rollback: bool = False
    owner_pid: int | None = None     # the dspark switch that wrote it (None: written by another tool)
    owner_start: int | None = None   # that process's start time (/proc/PID/stat, clock ticks since boot)

    def to_json(self) -> dict:
        return {"id": self.id, "from": self.from_line, "to": self.to_line, "at": self.at, "rollback": self.rollback,
                "owner_pid": self.owner_pid, "owner_start": self.owner_start}

    @classmethod
    def from_json(cls, d: object) -> Switch | None:
        if not isinstance(d, dict):
            return None
        try:
            owner = [d.get(k) if isinstance(d.get(k), int) and not isinstance(d.get(k), bool) else None
                     for k in ("owner_pid", "owner_start")]
            return cls(str(d["id"]), str(d["from"]), str(d["to"]), float(d["at"]), bool(d.get("rollback", False)),
                       *owner)
        except (KeyError, TypeError, ValueError, OverflowError):  # OverflowError: an "at" past a float's range
            return None


@dataclass(frozen=True)
class LineState:
    line: str
    file_line: str
    switch: Switch | None = None

    def to_json(self) -> dict:
        d = asdict(self)
        d["switch"] = self.switch.to_json() if self.switch else None
        return d


def process_start(pid: int) -> int | None:
    """A process's start time (clock ticks since boot), which tells it from a later process given
    the same PID; None when there is no such process (or /proc does not show it)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read(4096).rsplit(b")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def owned_switch(id: str, from_line: str, to_line: str, *, rollback: bool = False) -> Switch:
    """A switch record owned by this process."""
    pid = os.getpid()
    return Switch(id, from_line, to_line, time.time(), rollback, pid, process_start(pid))


def path(state_dir: Path) -> Path:
    return Path(state_dir) / FILE


def _parse(data: bytes) -> LineState:
    """The state file's content; CorruptState (a ValueError) when it is not one."""
    d = parse_json(data, max_bytes=state_io.MAX_STATE_BYTES, max_depth=state_io.STATE_JSON_DEPTH)
    if not isinstance(d, dict):
        raise state_io.CorruptState(f"{state_io.json_kind(d)}, not an object")
    line, file_line, sw = d.get("line"), d.get("file_line"), d.get("switch")
    if not isinstance(line, str) or not isinstance(file_line, str) or not line or not file_line:
        raise state_io.CorruptState("no line and file_line (two line names)")
    switch = Switch.from_json(sw) if sw is not None else None
    if sw is not None and switch is None:
        raise state_io.CorruptState("its switch is not a switch record (id, from, to, at)")
    return LineState(line, file_line, switch)


def read(state_dir: Path | None) -> LineState | None:
    """The state file, or None when there is none. One that is not a state file (a FIFO, a link,
    not JSON, the wrong shape) is moved aside with a warning (dspark.files.state_io): the file's line holds."""
    if state_dir is None:
        return None
    return state_io.read_state(path(state_dir), _parse, None, default_is="the cluster file's runtime line")


def write(state_dir: Path, state: LineState) -> None:
    """Atomically and durably (a reader sees the old file or the new one, never half of one)."""
    state_io.write_atomic(path(state_dir), json.dumps(state.to_json()) + "\n")


def current(state_dir: Path | None, file_line: str) -> LineState:
    """The line this node runs: its state's, unless the cluster file's line changed since."""
    st = read(state_dir)
    if st is None or st.file_line != file_line:
        return LineState(file_line, file_line)
    return st


def mtime(state_dir: Path | None) -> float | None:
    if state_dir is None:
        return None
    try:
        return os.lstat(path(state_dir)).st_mtime_ns / 1e9  # a link is read as one (refused), not followed
    except OSError:
        return None
