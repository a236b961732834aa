"""Levelled log lines for the long-running processes (`dspark serve`, `dspark dashboard`), through
the standard `logging` module.

A line's text is the same everywhere. Where the line goes to the journal (systemd set
$JOURNAL_STREAM to the device and inode of that very stream), it starts with the syslog
priority in angle brackets, `<3>` for an error, `<4>` a warning, `<5>` a notice, `<6>` info,
which journald reads and strips (SyslogLevelPrefix=, on by default), so that
`journalctl -p warning -u dspark-head` picks out what went wrong. A line without a prefix
(vLLM's own output, copied as it is) is info, journald's default.

Levels: ERROR a node failed (a FAILED state: pair broken, liveness lost, vLLM exited);
WARNING something was forced or refused (vLLM SIGKILLed after its grace, a failed liveness
round, a fallback); NOTICE a state change; INFO the rest.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import TextIO

NOTICE = 25  # between INFO and WARNING, as syslog's notice is between info and warning
logging.addLevelName(NOTICE, "NOTICE")

LOGGER = "dspark"
JOURNAL_ENV = "JOURNAL_STREAM"


def syslog_priority(level: int) -> int:
    """The syslog priority (sd-daemon(3)'s SD_ERR ... SD_DEBUG) of a logging level."""
    if level >= logging.CRITICAL:
        return 2
    if level >= logging.ERROR:
        return 3
    if level >= logging.WARNING:
        return 4
    if level >= NOTICE:
        return 5
    if level >= logging.INFO:
        return 6
    return 7


def to_journal(stream: TextIO, env: dict[str, str] | None = None) -> bool:
    """Whether `stream` is the journal's: $JOURNAL_STREAM ("DEV:INODE", systemd.exec(5)) names
    this file descriptor. A child that inherited the variable but writes elsewhere (a file, a
    pipe) gets no prefix."""
    value = (os.environ if env is None else env).get(JOURNAL_ENV, "")
    try:
        dev, ino = (int(x) for x in value.split(":"))
        st = os.fstat(stream.fileno())
    except (ValueError, OSError, AttributeError):  # unset or malformed; a stream without a descriptor
        return False
    return (st.st_dev, st.st_ino) == (dev, ino)


class LineHandler(logging.Handler):
    """Writes each record's message as one line (every line of it, should it hold several) to the
    stream the record names (`extra={"stream": ...}`), else to stderr at the time of writing;
    with the priority prefix where that stream is the journal's."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            stream = getattr(record, "stream", None) or sys.stderr
            text = record.getMessage()
            if to_journal(stream):
                p = f"<{syslog_priority(record.levelno)}>"
                text = "\n".join(p + line for line in text.split("\n"))
            stream.write(text + "\n")
            stream.flush()
        except Exception:  # noqa: BLE001 (logging's own convention: a failed write never raises)
            self.handleError(record)


def logger() -> logging.Logger:
    """The `dspark` logger with its one line handler (installed once; nothing propagates to the
    root logger, whose configuration, if any, belongs to whoever imported dspark)."""
    lg = logging.getLogger(LOGGER)
    if not any(isinstance(h, LineHandler) for h in lg.handlers):
        lg.addHandler(LineHandler())
        lg.setLevel(logging.INFO)
        lg.propagate = False
    return lg


def line(level: int, text: str, stream: TextIO | None = None) -> None:
    """Log `text` at `level`, to `stream` (default: stderr)."""
    logger().log(level, text, extra={"stream": stream})
