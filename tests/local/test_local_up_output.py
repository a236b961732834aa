"""What `dspark local up` prints, read as a new user would, against
the real local pair: the hints are commands that run as printed, the sample request shows what
the tiny model gives (its token ids) and says what it cannot do, the progress lines carry a
detail and one clock, in the order things happened, and a fresh pair has no restarts."""

import json
import re
import shlex
import subprocess

import pytest

from tests.harness.pair import ROOT

pytestmark = pytest.mark.pair

LINE = re.compile(r"^  (local-head|local-worker) +(\w+) +(.*?)  \[ *([\d.]+) s\]$")


def progress_lines(log: str) -> list[tuple[str, str, str, float]]:
    return [(m[1], m[2], m[3], float(m[4])) for m in map(LINE.match, log.splitlines()) if m]


def test_progress_lines_have_details_one_clock_and_time_order(local_pair):
    log = local_pair.log()
    lines = progress_lines(log)
    assert lines, log
    assert "seconds since local up started" in log
    assert all(detail.strip() for _, _, detail, _ in lines), lines
    times = [t for *_, t in lines]
    assert times == sorted(times), lines  # one clock across the phases, never restarting
    head_serving = next(i for i, (n, s, *_) in enumerate(lines) if (n, s) == ("local-head", "serving"))
    worker_states = [s for n, s, *_ in lines[:head_serving] if n == "local-worker"]
    assert "loading" in worker_states, lines  # the worker's loading shows before the head serves


def printed_command(log: str, word: str) -> list[str]:
    line = next(line for line in log.splitlines() if f" {word} --config " in line)
    return shlex.split(line.strip())


def test_the_printed_status_command_runs_as_printed_and_a_fresh_pair_has_no_restarts(local_pair):
    cmd = printed_command(local_pair.log(), "status")
    r = subprocess.run(cmd + ["--json"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 0, (cmd, r.stderr)
    nodes = json.loads(r.stdout)["nodes"]
    assert [n["restarts"] for n in nodes] == [0, 0], nodes


def test_the_printed_sample_request_is_a_chat_that_answers(local_pair):
    log = local_pair.log()
    i = next(k for k, line in enumerate(log.splitlines()) if line.strip().startswith("curl "))
    lines = log.splitlines()
    cmd = shlex.split(lines[i].strip().rstrip("\\") + " " + lines[i + 1].strip())
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    answer = json.loads(r.stdout)
    message = answer["choices"][0]["message"]
    assert message["role"] == "assistant" and isinstance(message["content"], str), answer
    assert 1 <= answer["usage"]["completion_tokens"] <= 16, answer
    assert "chat template" in log and "token-id prompts all work" in log

