"""Hostile state files under a running `dspark serve` (the stand-in vLLM, a real notify socket),
issue 33 items 12 and 13: a runtime-line.json nested 100,000 deep, a FIFO or a link to /dev/zero
in its place (at start, or swapped in while the head serves), `starts` as a FIFO, a failure
count of 1e999 or of thousands. The node starts (or waits out its backoff) and answers SIGTERM;
the file is moved aside with one line that says so; nothing blocks, crashes or grows.

Each supervisor runs with a 2 GiB address-space limit, so that a reader of /dev/zero fails
with MemoryError instead of filling this shared machine's memory."""

from __future__ import annotations

import json
import os
import resource
import signal
import time
from pathlib import Path

import pytest

from dspark.node.policy import EXIT_OK
from tests.harness.standin import write_cluster

MEMORY = 2 << 30
DONE_S = 30  # SIGTERM to exit: a stop of the stand-in takes a second or two; a blocked loop never ends


def start(serve, cluster: Path, **env):
    s = serve(cluster, "h", **env)
    resource.prlimit(s.proc.pid, resource.RLIMIT_AS, (MEMORY, MEMORY))  # its children inherit it
    return s


def plant(path: Path, kind: str) -> None:
    """`path` made hostile, in one step (a rename), as a swap under a running node would be."""
    tmp = path.with_name(path.name + ".planting")
    if kind == "deep":
        tmp.write_text("[" * 100_000)
    elif kind == "fifo":
        os.mkfifo(tmp)
    elif kind == "dev-zero":
        tmp.symlink_to("/dev/zero")
    elif kind == "1e999":
        tmp.write_text('{"consecutive": 1e999, "last": "x"}')
    else:
        raise ValueError(kind)
    os.replace(tmp, path)


def stop(s) -> str:
    """SIGTERM, the exit code checked, and everything the supervisor wrote."""
    s.proc.send_signal(signal.SIGTERM)
    try:
        rc = s.proc.wait(timeout=DONE_S)
    except Exception:
        s.proc.kill()
        out = s.proc.communicate(timeout=30)[0]
        raise AssertionError(f"SIGTERM unanswered for {DONE_S} s:\n{out[-3000:]}") from None
    out = s.proc.communicate(timeout=30)[0]
    assert rc == EXIT_OK and "Traceback" not in out, (rc, out[-3000:])
    return out


def moved_aside(state: Path, name: str, out: str) -> None:
    kept = sorted(state.glob(f"{name}.corrupt-*"))
    assert len(kept) == 1, (sorted(p.name for p in state.iterdir()), out[-3000:])
    said = [ln for ln in out.splitlines() if "moved aside" in ln]
    assert len(said) == 1 and name in said[0] and kept[0].name in said[0], out[-3000:]


CASES = [("runtime-line.json", "deep"), ("runtime-line.json", "fifo"), ("runtime-line.json", "dev-zero"),
         ("starts", "fifo"), ("failures.json", "1e999")]


@pytest.mark.parametrize("name,kind", CASES, ids=[f"{n}-{k}" for n, k in CASES])
def test_a_hostile_state_file_at_start_is_moved_aside_and_the_node_serves(tmp_path, serve, name, kind):
    cluster = write_cluster(tmp_path)
    state = tmp_path / "state-h"
    state.mkdir()
    plant(state / name, kind)
    s = start(serve, cluster, INVOCATION_ID="test")  # INVOCATION_ID: the failure history is kept (systemd)
    try:
        s.read(until="READY=1", timeout=60)
    except AssertionError:
        s.proc.kill()
        raise AssertionError(s.proc.communicate(timeout=30)[0][-3000:]) from None
    assert s.state()["state"] == "serving"
    moved_aside(state, name, stop(s))


def test_a_failure_count_in_the_thousands_waits_the_longest_backoff_and_answers_sigterm(tmp_path, serve):
    cluster = write_cluster(tmp_path)
    state = tmp_path / "state-h"
    state.mkdir()
    (state / "failures.json").write_text(json.dumps({"consecutive": 5000, "last": "exit 4: peer lost"}))
    s = start(serve, cluster, INVOCATION_ID="test")
    try:
        s.read(until="backoff:", timeout=60)
    except AssertionError:
        s.proc.kill()
        raise AssertionError(s.proc.communicate(timeout=30)[0][-3000:]) from None
    status = next(m for m in reversed(s.messages) if "backoff:" in m)
    assert "starting in 300 s" in status, status
    stop(s)
    d = json.loads((state / "failures.json").read_text())
    assert 0 < d["consecutive"] <= 1025 and d["last"] == "exit 4: peer lost", d  # clamped, and kept


def test_a_fifo_swapped_in_while_the_head_serves_is_moved_aside_and_sigterm_is_answered(tmp_path, serve):
    cluster = write_cluster(tmp_path)
    state = tmp_path / "state-h"
    s = start(serve, cluster)
    s.read(until="READY=1", timeout=60)
    plant(state / "runtime-line.json", "fifo")
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not list(state.glob("runtime-line.json.corrupt-*")):
        s.read(timeout=0.2)
    t0 = time.monotonic()
    out = stop(s)
    assert time.monotonic() - t0 < DONE_S
    moved_aside(state, "runtime-line.json", out)
