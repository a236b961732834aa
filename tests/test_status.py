"""`dspark wait-worker` and `dspark status` when nothing (or only a stand-in) runs."""

import json
import time
from pathlib import Path

from pairlib import run_dspark
from test_supervisor import write_cluster

FIXTURE = Path(__file__).parent / "fixtures" / "cluster-two-node.toml"


def test_wait_worker_times_out_with_a_clear_message(tmp_path):
    cluster = write_cluster(tmp_path, nodes=2)
    t0 = time.monotonic()
    r = run_dspark("wait-worker", "--config", str(cluster), "--timeout", "1.5")
    took = time.monotonic() - t0
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "worker not ready after 1.5 s: w at http://127.0.0.2:" in r.stderr and "is unreachable" in r.stderr
    assert 1.5 <= took < 15


def test_status_when_nothing_runs(tmp_path):
    cluster = write_cluster(tmp_path, nodes=2)
    r = run_dspark("status", "--config", str(cluster), "--json")
    assert r.returncode == 1
    snap = json.loads(r.stdout)
    assert snap["serving"] is False and snap["api"]["health"] is None
    assert [n["state"] for n in snap["nodes"]] == ["unreachable", "unreachable"]
    r = run_dspark("status", "--config", str(cluster))
    assert r.returncode == 1 and "pair: NOT SERVING" in r.stdout
