"""vLLM's log as dspark copies it: after a requested stop, vLLM's own abort reads as one line.

On SIGTERM (dspark's stop, systemd's, a Ctrl-C), which vLLM's API server announces with
vllm_facts.LOG_SHUTDOWN_SIGNALLED, vLLM 0.28.0 aborts what is in flight (`stopping engine client mode=abort`): its
output handler then fails with EngineDeadError, logged as one ERROR record of a dozen lines,
each carrying the record's prefix (`(APIServer pid=N) ERROR MM-DD hh:mm:ss [async_llm.py:744]`;
tests/fixtures/vllm-stop-abort.log is a real one). After a requested stop that record is the
expected end, not a crash: it is replaced by SHUTDOWN_ABORT_LINE. Every other record, and this
one without a signal before it (an engine that died: a crash), is copied as it is. Pure: lines
in, lines out; the marker comes from the log itself, so however vLLM was signalled, it holds.
"""

from __future__ import annotations

import re

from dspark.engine.facts import LOG_SHUTDOWN_SIGNALLED

# One logging record of vLLM at ERROR: the process tag (absent in a single-process run), level,
# time and source; vLLM repeats it on every line of a multi-line record.
ERROR_RECORD = re.compile(r"(?P<prefix>(?:\([\w.-]+ pid=\d+\) )?ERROR \d\d-\d\d \d\d:\d\d:\d\d \[[^\]\n]+\]) ")
ENGINE_DEAD = re.compile(r"^(?:[\w.]+\.)?EngineDeadError\b")
SHUTDOWN_ABORT_LINE = ("dspark: vLLM's shutdown abort (EngineDeadError in its output handler, expected on a "
                       "requested stop, not a crash; its traceback is left out): requests still in flight "
                       "get HTTP 500\n")
MAX_HELD = 400  # lines of one record held back at most; a longer one is copied as it is


def is_shutdown_abort(record: list[str], prefix: str) -> bool:
    """Whether a multi-line ERROR record is a traceback that ends in EngineDeadError."""
    body = [line[len(prefix):].strip() for line in record]
    return any(b.startswith("Traceback (most recent call last):") for b in body) and \
        bool(ENGINE_DEAD.match(body[-1]))


class ShutdownLog:
    """Feed vLLM's lines in order; write what `feed` and, at the end of the stream, `flush`
    return. Until vLLM announces a signal every line passes at once; after it an ERROR record
    is held until its last line (the next line without its prefix) to see whether it is the abort."""

    def __init__(self) -> None:
        self.stopping = False
        self.folded = 0  # abort records replaced by SHUTDOWN_ABORT_LINE
        self._held: list[str] = []
        self._prefix: str | None = None

    def feed(self, line: str) -> list[str]:
        if not self.stopping and LOG_SHUTDOWN_SIGNALLED in line:
            self.stopping = True
        m = ERROR_RECORD.match(line) if self.stopping else None
        prefix = m.group("prefix") if m else None
        if self._held and prefix == self._prefix and len(self._held) < MAX_HELD:
            self._held.append(line)
            return []
        out = self.flush()
        if prefix is None:
            out.append(line)
        else:
            self._held, self._prefix = [line], prefix
        return out

    def flush(self) -> list[str]:
        held, prefix = self._held, self._prefix
        self._held, self._prefix = [], None
        if held and prefix is not None and is_shutdown_abort(held, prefix):
            self.folded += 1
            return [SHUTDOWN_ABORT_LINE]
        return held
