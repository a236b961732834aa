"""A cleanly stopped node reads as stopped on the dashboard, never failed.

A real `dspark serve` (with the stand-in vLLM) and the dashboard's real collector polling its
agent once a second, as the page does: a stop that passes through `stopping` and `stopped`
faster than one poll used to leave only a refused connection, shown as FAILED."""

from __future__ import annotations

import signal
import time

from dspark.config import validate as C
from dspark.dashboard import collector as D
from tests.harness.standin import write_cluster


def poll_until(col: D.Collector, pred, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    snap = col.snapshot()
    while not pred(snap) and time.monotonic() < deadline:
        time.sleep(0.1)
        snap = col.snapshot()
    return snap


def test_a_cleanly_stopped_head_reads_stopped_not_failed(tmp_path, serve):
    cluster_file = write_cluster(tmp_path)
    s = serve(cluster_file, "h")
    s.read(until="READY=1")
    col = D.Collector(D.Targets.from_cluster(C.load(cluster_file)), interval_s=1.0).start()
    try:
        snap = poll_until(col, lambda sn: sn.get("nodes") and sn["nodes"][0]["state"] == "serving", 10)
        assert snap["nodes"][0]["state"] == "serving", snap["nodes"]
        s.proc.send_signal(signal.SIGTERM)
        assert s.wait() == 0
        time.sleep(2.5)  # two more polls: the agent is gone by now
        node = col.snapshot()["nodes"][0]
    finally:
        col.stop()
    assert node["state"] == "stopped", node
    assert "fail" not in node["detail"], node
