"""Which runtime line a node runs: appliance state kept in the node's state directory.

The cluster file names the pair's line (`serving.runtime_line`); `dspark switch` moves a running
pair to another installed line (`serving.line_commands`) without editing that file, so the line
a node runs is state, the same on every node of a pair:

    <state dir>/runtime-line.json   {"line": "v0.32.0", "file_line": "v0.28.0",
                                     "switch": {"id": ..., "from": ..., "to": ..., "at": ...,
                                                "rollback": false} | null}

`file_line` is the cluster file's line when the state was written: a cluster file that names
another line since (a new deployment, a NixOS generation) supersedes the state. `switch` is set
while a switch (or its rollback) is under way and cleared once the pair serves the line and the
verdict is in. The head's file is written by `dspark switch`; a worker writes its own when it
follows its head onto a line (dspark.node_policy), so that a worker restarted alone comes back
on the pair's line.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

FILE = "runtime-line.json"


@dataclass(frozen=True)
class Switch:
    id: str
    from_line: str
    to_line: str
    at: float
    rollback: bool = False

    def to_json(self) -> dict:
        return {"id": self.id, "from": self.from_line, "to": self.to_line, "at": self.at, "rollback": self.rollback}

    @classmethod
    def from_json(cls, d: object) -> "Switch | None":
        if not isinstance(d, dict):
            return None
        try:
            return cls(str(d["id"]), str(d["from"]), str(d["to"]), float(d["at"]), bool(d.get("rollback", False)))
        except (KeyError, TypeError, ValueError):
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


def path(state_dir: Path) -> Path:
    return Path(state_dir) / FILE


def read(state_dir: Path | None) -> LineState | None:
    """The state file, or None when there is none (or it cannot be read: the file's line holds)."""
    if state_dir is None:
        return None
    try:
        d = json.loads(path(state_dir).read_text())
        line, file_line = d["line"], d["file_line"]
        if not isinstance(line, str) or not isinstance(file_line, str) or not line or not file_line:
            return None
        return LineState(line, file_line, Switch.from_json(d.get("switch")))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def write(state_dir: Path, state: LineState) -> None:
    """Atomically (a reader sees the old file or the new one, never half of one)."""
    p = path(state_dir)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(state.to_json()) + "\n")
    os.replace(tmp, p)


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
        return path(state_dir).stat().st_mtime_ns / 1e9
    except OSError:
        return None
