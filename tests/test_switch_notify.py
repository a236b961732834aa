"""A runtime-line switch under systemd's notify protocol (`dspark serve` as a real process with
a stand-in vLLM and a real notify socket): the switch ends vLLM's run and starts the next one on
the new line in the same process, so the unit is not stopping. STOPPING=1 cannot be taken back:
systemd would keep the unit deactivating and kill it TimeoutStopSec later, in the middle of the
switch (tests/systemd/test_switch_under_systemd.py saw the worker killed, result 'timeout')."""

from __future__ import annotations

import sys
import time
import tomllib

from standin_lib import STANDIN, write_cluster

from dspark import config as C
from dspark import line_state

A, B = "v0.28.0", "v0.29.0"


def test_a_switch_restarts_vllm_on_the_new_line_without_stopping_the_unit(tmp_path, serve):  # noqa: F811
    path = write_cluster(tmp_path, drain_s=1.0)
    data = tomllib.loads(path.read_text())
    data["serving"]["line_commands"] = {A: [sys.executable, str(STANDIN)], B: [sys.executable, str(STANDIN)]}
    path.write_text(C.dumps(data))
    s = serve(path, "h", STANDIN_READY_DELAY=0.5)
    s.read(until="READY=1")
    before = len(s.messages)
    line_state.write(tmp_path / "state-h", line_state.LineState(B, A, line_state.Switch("t", A, B, time.time())))
    deadline, st = time.monotonic() + 60, {}
    while time.monotonic() < deadline:
        s.read(timeout=0.5)
        st = s.state()
        if st["state"] == "serving" and st["runtime_line"] == B:
            break
    assert st["state"] == "serving" and st["runtime_line"] == B, st
    s.read(until="WATCHDOG=1", timeout=10)  # the watchdog runs on, on the new line
    after = s.messages[before:]
    assert any("switching from runtime line" in m for m in after), after
    assert not any(m.startswith("STOPPING=1") or "\nSTOPPING=1" in m for m in after), after
    assert s.proc.poll() is None
