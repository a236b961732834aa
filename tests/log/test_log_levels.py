"""Levelled log lines (dspark.log): where the stream is the journal's ($JOURNAL_STREAM names its
device and inode, as systemd sets it) each dspark line carries journald's `<N>` priority
prefix; anywhere else the lines are exactly as before. Checked in-process and on a real
`dspark serve` against the stand-in vLLM."""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from dspark import log as L
from dspark.node.policy import EXIT_DIED, EXIT_OK
from tests.harness.pair import dspark_cmd
from tests.harness.standin import write_cluster

PREFIX = re.compile(r"^<(\d)>")


def journal_of(path: Path) -> str:
    st = os.stat(path)
    return f"{st.st_dev}:{st.st_ino}"


@pytest.mark.parametrize("level, prio", [(logging.ERROR, 3), (logging.WARNING, 4), (L.NOTICE, 5),
                                         (logging.INFO, 6)])
def test_a_line_to_the_journal_stream_carries_its_priority(tmp_path, monkeypatch, level, prio):
    path = tmp_path / "journal"
    with open(path, "w") as f:
        monkeypatch.setenv("JOURNAL_STREAM", journal_of(path))
        L.line(level, "dspark[h]: two\nlines", f)
    assert path.read_text() == f"<{prio}>dspark[h]: two\n<{prio}>lines\n"


@pytest.mark.parametrize("journal", [None, "elsewhere", "garbage"])
def test_a_line_elsewhere_has_no_prefix(tmp_path, monkeypatch, journal):
    path, other = tmp_path / "log", tmp_path / "other"
    other.write_text("")
    with open(path, "w") as f:
        if journal is None:
            monkeypatch.delenv("JOURNAL_STREAM", raising=False)
        else:  # inherited from a parent that wrote to the journal, but this stream is a file
            monkeypatch.setenv("JOURNAL_STREAM", journal_of(other) if journal == "elsewhere" else "x:y")
        L.line(logging.WARNING, "dspark[h]: vLLM did not exit within 2 s; SIGKILL", f)
    assert path.read_text() == "dspark[h]: vLLM did not exit within 2 s; SIGKILL\n"


def run_serve(tmp_path: Path, name: str, journal: bool, until: str, **standin) -> tuple[int, list[str]]:
    """`dspark serve` with its output in a file (the journal's stream when `journal`); SIGTERM
    once `until` is in its log (None: wait for its exit). Returns the exit code and the lines."""
    (tmp_path / name).mkdir()
    cluster = write_cluster(tmp_path / name, stop_grace_s=1.5, drain_s=0.0)
    path = tmp_path / name / "out.log"
    env = {k: v for k, v in os.environ.items() if k not in ("JOURNAL_STREAM", "NOTIFY_SOCKET", "WATCHDOG_USEC")}
    env.update({k: str(v) for k, v in standin.items()})
    with open(path, "w") as out:
        if journal:
            env["JOURNAL_STREAM"] = journal_of(path)
        proc = subprocess.Popen(dspark_cmd("serve", "--config", str(cluster), "--node", "h", "--skip-plan",
                                           "--state-dir", str(tmp_path / name / "state")),
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    try:
        if until is not None:
            deadline = time.monotonic() + 60
            while until not in path.read_text() and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)
            assert until in path.read_text(), path.read_text()
            proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return rc, path.read_text().splitlines()


def by_level(lines: list[str]) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for line in lines:
        m = PREFIX.match(line)
        out.setdefault(int(m.group(1)) if m else 6, []).append(line[m.end():] if m else line)
    return out


def test_serve_under_the_journal_marks_a_sigkill_escalation_a_warning_and_states_notices(tmp_path):
    rc, lines = run_serve(tmp_path, "kill", True, "serving: API on", STANDIN_IGNORE_TERM=1)
    assert rc == EXIT_OK
    levels = by_level(lines)
    assert levels[4] == ["dspark[h]: vLLM did not exit within 1.5 s; SIGKILL"], lines
    assert "dspark[h]: starting: rank 0 of 1" in levels[5], lines
    assert any(x.startswith("dspark[h]: stopped") for x in levels[5]), lines
    assert any(x.startswith("dspark[h]: starting vLLM: ") for x in levels[6]), lines
    assert 3 not in levels, lines
    # vLLM's own output is copied as it is: no prefix (journald files it as info)
    assert any(x.startswith("INFO standin") for x in lines), lines
    assert all(PREFIX.match(x) for x in lines if x.startswith("<") or x.startswith("dspark[h]")), lines


def test_serve_under_the_journal_marks_a_failed_node_an_error(tmp_path):
    rc, lines = run_serve(tmp_path, "died", True, None, STANDIN_EXIT_AFTER=3)
    assert rc == EXIT_DIED
    errors = by_level(lines).get(3, [])
    assert errors and all(x.startswith("dspark[h]: failed: ") for x in errors), lines


def test_serve_outside_the_journal_writes_the_same_lines_without_a_prefix(tmp_path):
    rc, lines = run_serve(tmp_path, "plain", False, "serving: API on", STANDIN_IGNORE_TERM=1)
    assert rc == EXIT_OK
    assert not [x for x in lines if PREFIX.match(x)], lines
    assert "dspark[h]: vLLM did not exit within 1.5 s; SIGKILL" in lines
    assert "dspark[h]: starting: rank 0 of 1" in lines


def test_the_units_leave_journald_reading_the_prefix():
    """SyslogLevelPrefix= is on by default: no unit dspark writes turns it off, and every unit
    that runs dspark sends its output to the journal (systemd's default: no StandardOutput=)."""
    from dspark.units.render import render_units

    units = render_units("/usr/bin/dspark")
    assert any("dspark serve" in text or " serve" in text for text in units.values())
    for name, text in units.items():
        assert "SyslogLevelPrefix" not in text, name
        assert "StandardOutput=" not in text and "StandardError=" not in text, name
