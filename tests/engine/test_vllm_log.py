"""A requested stop reads as clean in the head's log: vLLM's EngineDeadError
traceback of its shutdown abort becomes one line; a crash, and every other traceback, is copied
as vLLM wrote it. On vLLM 0.28.0's real text (tests/fixtures, from a `local up` pair stopped with
three requests in flight, and a traceback vLLM logged while serving)."""

from __future__ import annotations

from pathlib import Path

from dspark.engine.facts import LOG_SHUTDOWN_SIGNALLED
from dspark.engine.log import SHUTDOWN_ABORT_LINE, ShutdownLog

FIXTURES = Path(__file__).parents[1] / "fixtures"
STOP = (FIXTURES / "vllm-stop-abort.log").read_text().splitlines(keepends=True)
OTHER = (FIXTURES / "vllm-tool-parser-traceback.log").read_text().splitlines(keepends=True)
SIGNALLED = [line for line in STOP if LOG_SHUTDOWN_SIGNALLED in line]  # vLLM's API server got SIGTERM


def copied(lines: list[str]) -> list[str]:
    log = ShutdownLog()
    out = []
    for line in lines:
        out += log.feed(line)
    return out + log.flush()


def test_the_real_text_holds_one_engine_dead_traceback():  # the fixture is what the filter is about
    text = "".join(STOP)
    assert text.count("Traceback (most recent call last):") == 1 and "EngineDeadError" in text
    assert text.count('"POST /v1/completions HTTP/1.1" 500') == 3
    assert len(SIGNALLED) == 1 and STOP.index(SIGNALLED[0]) < min(i for i, x in enumerate(STOP) if "Traceback" in x)


def test_after_a_requested_stop_the_abort_is_one_line_and_the_rest_is_kept_in_order():
    out = copied(STOP)
    text = "".join(out)
    assert "Traceback" not in text and "EngineDeadError" not in text.replace(SHUTDOWN_ABORT_LINE, "")
    assert out.count(SHUTDOWN_ABORT_LINE) == 1
    record = [line for line in STOP if "[async_llm.py:744]" in line]
    assert len(record) == 8
    at = STOP.index(record[0])
    assert out == STOP[:at] + [SHUTDOWN_ABORT_LINE] + STOP[at + len(record):]


def test_without_a_signal_the_traceback_is_a_crash_and_copied_whole():
    crash = [line for line in STOP if line not in SIGNALLED]  # an engine that died: no signal logged
    assert copied(crash) == crash


def test_another_traceback_after_a_stop_is_copied_whole():
    assert copied(SIGNALLED + OTHER + STOP[:3]) == SIGNALLED + OTHER + STOP[:3]


def test_a_stream_that_ends_inside_the_record_still_folds_it():
    last = max(i for i, line in enumerate(STOP) if "EngineDeadError" in line)
    out = copied(STOP[: last + 1])
    assert out[-1] == SHUTDOWN_ABORT_LINE and "Traceback" not in "".join(out)


def test_lines_pass_at_once_until_the_signal():
    log = ShutdownLog()
    assert all(log.feed(line) == [line] for line in OTHER + SIGNALLED)
    assert log.feed(OTHER[0]) == [] and log.flush() == [OTHER[0]]  # after it an ERROR record is held
