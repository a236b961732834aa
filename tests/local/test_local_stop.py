"""`local up`'s stop keeps the bound it prints (issue 34, item 2): the real `dspark local up`, its
supervisors and agents, on a runtime line whose vLLM is the stand-in (test_local_dir_lock's
`appliances`), so that vLLM can be made to hold a request and ignore SIGTERM.

Before: with one stream open, Ctrl-C printed "its requests in flight finish within 60 s" and took
88-94 s; a second Ctrl-C was ignored without a word; after a clean stop the worker's log said
`failed: pair broken: local-head: it is stopped` and the dashboard showed it FAILED."""

from __future__ import annotations

import json
import re
import signal
import threading
import time
import urllib.request
from contextlib import contextmanager

from dspark.config import validate as C
from dspark.local import cluster
from dspark.local.lock import left_behind
from dspark.local.stop import planned_stop_s
from tests.harness.pair import dspark_cmd, pick_ports
from tests.local.test_local_dir_lock import Appliances, standin_line  # noqa: F401 (standin_line: a fixture)


def bound_of(workdir) -> float:
    return planned_stop_s(C.load(workdir / "cluster.toml").supervisor)


def hold_a_request(port: int) -> threading.Thread:
    """One completion the stand-in runs for minutes (STANDIN_TOKEN_S x max_tokens)."""
    def send() -> None:
        body = json.dumps({"model": cluster.SERVED_NAME, "prompt": [1, 2, 3], "max_tokens": 1000}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                     {"Content-Type": "application/json"})
        try:
            urllib.request.urlopen(req, timeout=600).close()
        except OSError:
            pass  # cut by the stop
    t = threading.Thread(target=send, daemon=True)
    t.start()
    return t


def stop_and_time(p, out, *, again_after: float | None = None, limit: float = 300) -> tuple[float, str]:
    t0 = time.monotonic()
    p.send_signal(signal.SIGINT)
    if again_after is not None:
        time.sleep(again_after)
        p.send_signal(signal.SIGINT)
    p.wait(timeout=limit)
    return time.monotonic() - t0, out.read_text()


def test_a_clean_stop_prints_its_bound_keeps_it_and_the_worker_ends_stopped(tmp_path, standin_line):  # noqa: F811
    a = Appliances(tmp_path / "d", *standin_line)
    try:
        out = tmp_path / "up.out"
        p = a.start(dspark_cmd(*a.up_args(pick_ports())), out)
        bound = bound_of(a.workdir)
        took, text = stop_and_time(p, out)
    finally:
        a.close()
    assert p.returncode == 0, text
    said = re.search(r"done within (\d+) s", text)
    assert said and float(said.group(1)) == bound, text
    stopped = re.search(r"stopped; no process left behind \(the stop took ([\d.]+) s\)", text)
    assert stopped and float(stopped.group(1)) <= bound and took <= bound + 5, text
    worker_log = (a.workdir / "logs" / f"{cluster.WORKER_NAME}.log").read_text()
    assert f"stopped: its head {cluster.HEAD_NAME} stopped" in worker_log, worker_log[-2000:]
    assert "failed" not in worker_log.split("serving: pair serving")[-1], worker_log[-2000:]


@contextmanager
def holding_a_request(tmp_path, line_env):
    """A running `local up` whose vLLM (the stand-in) ignores SIGTERM and runs one request for
    minutes: (its process, its output file). Stopped and swept after the block."""
    line, env = line_env
    a = Appliances(tmp_path / "d", line, {**env, "STANDIN_IGNORE_TERM": "1", "STANDIN_TOKEN_S": "0.5"})
    try:
        ports = pick_ports()
        p = a.start(dspark_cmd(*a.up_args(ports)), tmp_path / "up.out")
        hold_a_request(ports.api)
        time.sleep(2)
        yield a, p
    finally:
        a.close()


def test_a_vllm_that_overstays_its_drain_is_killed_within_the_printed_bound(tmp_path, standin_line):  # noqa: F811
    """vLLM ignores SIGTERM with a request in flight: the head kills it at drain_s + stop_grace_s
    and the whole stop ends within the bound printed (75 s of drain and grace here)."""
    with holding_a_request(tmp_path, standin_line) as (a, p):
        bound = bound_of(a.workdir)
        took, text = stop_and_time(p, tmp_path / "up.out", limit=bound + 60)
        assert took <= bound + 5, (took, bound, text)  # + 5: local up's own exit after the stop
        assert f"done within {bound:g} s" in text and "no process left behind" in text, text
        head_log = (a.workdir / "logs" / f"{cluster.HEAD_NAME}.log").read_text()
        assert "drain_s + stop_grace_s" in head_log, head_log[-2000:]
        assert left_behind(a.workdir) == []


def test_a_second_ctrl_c_kills_every_node_at_once_and_says_so(tmp_path, standin_line):  # noqa: F811
    with holding_a_request(tmp_path, standin_line) as (a, p):
        took, text = stop_and_time(p, tmp_path / "up.out", again_after=3.0, limit=120)
        assert took < 30, (took, text)  # not the 75 s of drain and grace
        assert "a second signal: every node killed at once (SIGKILL)" in text and "no process left behind" in text
        assert left_behind(a.workdir) == []
