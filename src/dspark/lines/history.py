"""The switches kept on a head, and the one way a switch whose `dspark switch` is gone ends.

<state dir>/switch-history.json holds one record per switch (dspark.switch writes it: a
`running` record when it starts, the verdict when it ends). While a switch runs, its process
holds <state dir>/.switch.lock (flock) and the head's runtime-line.json carries its switch
record with the owner's PID and start time (dspark.lines.state). A `dspark switch` that is killed
(kill -9, the host's OOM killer, a lost SSH session) releases the lock and leaves that record
behind: `resolve_abandoned` goes on with it. It takes the lock (so no switch is running, and
none starts meanwhile) and does what the switch would have done: a new line that serves is kept
(`abandoned`: not measured), one that does not is rolled back, a rollback is completed (or, past
the switch's timeout, recorded as failed); then the record is cleared, so that nothing holds a
failed node for it and the next switch is not refused. The head's supervisor runs it at start and
every few seconds while its state carries a record; `dspark switch` runs it before its checks.
"""

from __future__ import annotations

import fcntl
import json
import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol

from dspark import log as L
from dspark.files import state_io
from dspark.files.safe_read import parse_json
from dspark.lines import state as line_state


class _Timings(Protocol):
    """The supervisor settings a switch's time limit is made of (config.schema.SupervisorConfig)."""
    @property
    def ready_timeout_s(self) -> float: ...
    @property
    def drain_s(self) -> float: ...
    @property
    def stop_grace_s(self) -> float: ...

HISTORY = "switch-history.json"
MAX_HISTORY_BYTES = 16 << 20  # a record is under 1 KiB: thousands of switches
LOCK = ".switch.lock"

# Verdicts. `running` is the record of a switch under way (or of one killed before the head
# resolved it); `abandoned`, one whose `dspark switch` ended without a verdict.
RUNNING, KEPT, NOT_STARTED, ROLLED_BACK, ROLLBACK_FAILED, ABANDONED = (
    "running", "kept", "not started", "rolled back", "rollback failed", "abandoned")


@dataclass
class Record:
    id: str
    started_at: float
    from_line: str
    to_line: str
    verdict: str = RUNNING
    reason: str = ""
    band: float | None = None
    gain: float | None = None
    down_s: float | None = None       # time the pair did not serve, switch (and rollback) together
    serving_on: str | None = None     # the line the pair serves when the switch ends
    reports: list[str] = field(default_factory=list)
    ended_at: float | None = None


def _number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_record(h: object) -> bool:
    """A switch record as history_table shows it: the fields it formats have their types."""
    if not isinstance(h, dict):
        return False
    t = h.get("started_at")
    return (all(isinstance(h.get(k), str) for k in ("id", "from_line", "to_line", "verdict"))
            and isinstance(h.get("reason", ""), str) and isinstance(h.get("serving_on"), (str, type(None)))
            and isinstance(t, (int, float)) and not isinstance(t, bool) and 0 <= t < 1e11  # time.gmtime's range
            and all(h.get(k) is None or _number(h.get(k)) for k in ("band", "gain", "down_s", "ended_at")))


def _parse_history(data: bytes) -> tuple[list[dict], int]:
    """(the records, how many entries are not records)."""
    v = parse_json(data, max_bytes=MAX_HISTORY_BYTES, max_depth=state_io.STATE_JSON_DEPTH)
    if not isinstance(v, list):
        raise state_io.CorruptState(f"{state_io.json_kind(v)}, not a list of switches")
    records = [h for h in v if _is_record(h)]
    return records, len(v) - len(records)


def _load(state_dir: Path) -> tuple[list[dict], int]:
    """A history that is not one (not JSON, not a list, a FIFO, a link, too large) is moved aside
    (dspark.files.state_io), never read as empty and then replaced."""
    empty: tuple[list[dict], int] = ([], 0)
    return state_io.read_state(Path(state_dir) / HISTORY, _parse_history, empty, default_is="an empty history",
                               max_bytes=MAX_HISTORY_BYTES)


def read(state_dir: Path) -> list[dict]:
    """The switches recorded on this head. Entries that are not switch records are left out, and
    said; the next switch keeps the file as it was beside the history it writes."""
    hist, odd = _load(state_dir)
    if odd:
        L.line(logging.WARNING, f"dspark: {Path(state_dir) / HISTORY}: {odd} entries are not switch records: "
                                "left out")
    return hist


def save(state_dir: Path, rec: Record) -> None:
    """`rec` added to the history (or in place of its earlier self), atomically and durably."""
    path = Path(state_dir) / HISTORY
    hist, odd = _load(state_dir)
    if odd:
        state_io.set_aside(path, f"{odd} entries are not switch records", "the records that are", keep=True)
    hist = [h for h in hist if h.get("id") != rec.id] + [asdict(rec)]
    state_io.write_atomic(path, json.dumps(hist, indent=1) + "\n")


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:+.1%}"


def table(hist: list[dict]) -> str:
    if not hist:
        return "no switch recorded"
    rows = [("WHEN (UTC)", "FROM", "TO", "VERDICT", "BAND", "GAIN", "DOWN", "SERVING ON", "WHY")]
    for h in hist:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(h.get("started_at") or 0))
        rows.append((when, h.get("from_line", "?"), h.get("to_line", "?"), h.get("verdict", "?"),
                     "-" if h.get("band") is None else f"{h['band']:.1%}", _pct(h.get("gain")),
                     "-" if h.get("down_s") is None else f"{h['down_s']:.0f} s", h.get("serving_on") or "-",
                     h.get("reason", "")))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)) + "  " + r[-1] for r in rows)


# ------------------------------------------------------------------ a switch whose owner is gone
def base_id(switch_id: str) -> str:
    """The switch a line-state record belongs to (a rollback's record is `<id>-rollback`)."""
    return switch_id.removesuffix("-rollback")


def timeout_s(sup: _Timings) -> float:
    """How long a switch (or its rollback) has to serve by default: the supervisor settings'
    ready_timeout_s + drain_s + stop_grace_s + 60 (dspark switch --timeout)."""
    return sup.ready_timeout_s + sup.drain_s + sup.stop_grace_s + 60


def resolve_abandoned(state_dir: Path, file_line: str, *, by: str, serving_on: str | None,
                      limit_s: float) -> Record | None:
    """Go on with the switch the head's state still carries when no `dspark switch` holds the
    lock. `serving_on`: the line the pair serves now (None: not serving, or not known).
      - the pair serves the line the state names: the switch ends there, `rolled back` for a
        rollback (completed), `abandoned` for a switch (the new line serves, not measured);
      - a switch whose new line does not serve: rolled back, as `dspark switch` would have done
        (the state names the old line with a rollback record of no owner; recorded `running`);
      - a rollback that does not serve: left to go on until `limit_s` after it began, then
        `rollback failed` and the record cleared (nothing holds a node for it any longer).
    The record stays while the pair moves, so that a worker whose head restarts on the line it
    runs re-forms the pair (dspark.node.policy) instead of failing. Returns the history record
    written, or None when nothing changed: no record, a switch running, or a lock that cannot be
    opened here. `by` names who did it (in the reason). OSError from the writes is the caller's."""
    state_dir = Path(state_dir)
    st = line_state.read(state_dir)
    if st is None or st.switch is None:
        return None
    try:
        lock = state_io.open_lock(state_dir / LOCK)
    except OSError:
        return None  # a lock planted as a link or a FIFO, or not ours to open: nothing decided here
    try:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return None  # a switch runs: its record is its own
        st = line_state.read(state_dir)  # again, under the lock: the switch may have ended meanwhile
        if st is None or st.switch is None:
            return None
        return _go_on(state_dir, st, st.switch, file_line, by, serving_on, limit_s)
    finally:
        lock.close()


def _go_on(state_dir: Path, st: line_state.LineState, sw: line_state.Switch, file_line: str, by: str,
           serving_on: str | None, limit_s: float) -> Record | None:
    known = {h.get("id"): h for h in read(state_dir)}.get(base_id(sw.id))
    rec = Record(**{k: v for k, v in known.items() if k in Record.__dataclass_fields__}) if known else Record(
        id=base_id(sw.id), started_at=sw.at, from_line=sw.to_line if sw.rollback else sw.from_line,
        to_line=sw.from_line if sw.rollback else sw.to_line)
    line = st.line if st.file_line == file_line else file_line  # the line the head runs (line_state.current)
    owner = f"dspark switch (pid {sw.owner_pid})" if sw.owner_pid else "its dspark switch"
    gone = f"{owner} ended without a verdict" if rec.verdict == RUNNING and sw.owner_pid else ""
    why = "; ".join(x for x in (rec.reason, gone) if x)
    clear = line_state.LineState(st.line, st.file_line, None)
    if serving_on == line:
        if sw.rollback:
            rec.verdict, rec.reason = ROLLED_BACK, f"{why}; the rollback completed by {by}: serving on {line}"
        else:
            rec.verdict, rec.reason = ABANDONED, f"{why} after the head's state named {line}; {by}: the pair " \
                                                 f"serves {line}, not measured"
        rec.serving_on, rec.ended_at = line, time.time()
        save(state_dir, rec)  # first: a crash between the two writes ends it again, the same way
        line_state.write(state_dir, clear)
        return rec
    if sw.rollback:
        if time.time() - sw.at < limit_s:
            return None  # the way back goes on
        rec.verdict, rec.serving_on, rec.ended_at = ROLLBACK_FAILED, None, time.time()
        rec.reason = f"{why}; the rollback to {line} did not serve within {limit_s:g} s ({by})"
        save(state_dir, rec)
        line_state.write(state_dir, clear)
        return rec
    back = rec.from_line
    rec.verdict = RUNNING
    rec.reason = f"{why} before {sw.to_line} served; {by} rolls the pair back to {back}"
    save(state_dir, rec)
    line_state.write(state_dir, line_state.LineState(back, st.file_line, line_state.Switch(
        rec.id + "-rollback", sw.to_line, back, time.time(), rollback=True)))
    return rec
