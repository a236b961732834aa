"""The plan: what the Nix build of a runtime line reads (nix/lines.nix's line, its lock,
nix/runtime-build.json), read the same way; and the one error of bad input."""

from __future__ import annotations

import json
import os
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

NIX = Path(__file__).resolve().parent.parent  # nix/
REPO = NIX.parent
LOCK = NIX / "runtime-lock.json"
BUILD = NIX / "runtime-build.json"
LINES = REPO / "src" / "dspark" / "data" / "runtime_lines.toml"
APPLY_OVERLAY = NIX / "apply-overlay.py"
DEFAULT_CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dspark" / "runtime-wheels"


class ReplayError(Exception):
    """Bad input or a missing tool: reported as one line, exit status 2."""


@dataclass(frozen=True)
class Wheel:
    name: str
    version: str
    filename: str
    sha256: str


def load_plan(lock_path: Path = LOCK, build_path: Path = BUILD) -> tuple[list[Wheel], dict[str, Any]]:
    """The wheels in the order runtime.nix installs them (the lock's order), and the build data."""
    try:
        lock = json.loads(lock_path.read_text())
        build = json.loads(build_path.read_text())
        wheels = [Wheel(p["name"], p["version"], p["filename"], p["sha256"]) for p in lock["packages"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ReplayError(f"cannot read {lock_path.name} / {build_path.name}: {e}") from e
    return wheels, build


@dataclass(frozen=True)
class Line:
    """One runtime line as nix/lines.nix reads it for the build."""

    id: str
    vllm: str
    lock: Path
    series: tuple[Path, ...]  # the patches, in order


def read_series_file(path: Path) -> tuple[Path, ...]:
    """A series file as dspark.overlay and nix/lines.nix read it: one patch a line, a path relative
    to the file's folder; blank and `#` lines skipped."""
    entries = [s.strip() for s in path.read_text().splitlines()]
    series = tuple((path.parent / e).resolve() for e in entries if e and not e.startswith("#"))
    missing = [str(p) for p in series if not p.is_file()]
    if missing:
        raise ReplayError(f"{path} names {missing[0]}, which is not there")
    return series


def load_line(line_id: str | None = None, lines_path: Path = LINES, repo: Path = REPO) -> Line:
    """The line (default: the data's default line) as nix/lines.nix reads it: its lock, and its
    series, read from its `series_file` (or, without one, its `series.applies` from overlay/)."""
    try:
        data = tomllib.loads(lines_path.read_text())
        line_id = line_id or data["default"]
        if line_id not in data["lines"]:
            raise ReplayError(f"{line_id!r} is not a runtime line; known: {', '.join(sorted(data['lines']))}")
        raw = data["lines"][line_id]
        if raw["lock_state"] != "locked":
            raise ReplayError(f"runtime line {line_id} has no complete lock (lock_state {raw['lock_state']!r})")
        if "series_file" in raw:
            series = read_series_file(repo / raw["series_file"])
        else:
            series = tuple(repo / "overlay" / n for n in raw.get("series", {}).get("applies", []))
        return Line(line_id, raw["vllm"], repo / raw["lock"], series)
    except (OSError, tomllib.TOMLDecodeError, KeyError, TypeError) as e:
        raise ReplayError(f"cannot read the runtime lines from {lines_path}: {e}") from e


def installer_wheel(build: dict[str, Any]) -> Wheel:
    i = build["installer"]
    return Wheel(i["name"], i["version"], i["filename"], i["sha256"])

