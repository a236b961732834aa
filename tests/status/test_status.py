"""`dspark wait-worker` and `dspark status` when nothing (or only a stand-in) runs."""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from dspark.config import validate as C
from dspark.config.template import dumps
from tests.harness.dspark_cli import invoke_dspark
from tests.harness.pair import dspark_cmd
from tests.harness.standin import STANDIN, free_port, write_cluster

FIXTURE = Path(__file__).parents[1] / "fixtures" / "cluster-two-node.toml"


def test_wait_worker_times_out_with_a_clear_message(tmp_path):
    cluster = write_cluster(tmp_path, nodes=2)
    t0 = time.monotonic()
    r = invoke_dspark("wait-worker", "--config", str(cluster), "--timeout", "1.5")
    took = time.monotonic() - t0
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "worker not ready after 1.5 s: w at http://127.0.0.2:" in r.stderr and "is unreachable" in r.stderr
    assert 1.5 <= took < 15


def test_status_when_nothing_runs(tmp_path):
    cluster = write_cluster(tmp_path, nodes=2)
    r = invoke_dspark("status", "--config", str(cluster), "--json")
    assert r.returncode == 1
    snap = json.loads(r.stdout)
    assert snap["serving"] is False and snap["api"]["health"] is None
    assert [n["state"] for n in snap["nodes"]] == ["unreachable", "unreachable"]
    r = invoke_dspark("status", "--config", str(cluster))
    assert r.returncode == 1 and "pair: NOT SERVING" in r.stdout


def write_ring(tmp: Path, workers: int = 3) -> Path:
    """A head and `workers` workers (w1 on 127.0.0.2, w2 on 127.0.0.3, ...) running the stand-in."""
    (tmp / "model").mkdir(exist_ok=True)
    entries = [{"name": "h", "rank": 0, "address": "127.0.0.1", "api_host": "127.0.0.1", "api_port": free_port(),
                "agent_port": free_port(), "master_port": free_port()}]
    entries += [{"name": f"w{r}", "rank": r, "address": f"127.0.0.{r + 1}", "agent_port": free_port(f"127.0.0.{r + 1}")}
                for r in range(1, workers + 1)]
    data = {"model": {"path": str(tmp / "model"), "served_name": "m"},
            "serving": {"vllm_command": [sys.executable, str(STANDIN)], "tensor_parallel_size": workers + 1,
                        "speculative_config": {}},
            "supervisor": {"stop_grace_s": 2.0, "worker_wait_timeout_s": 60.0, "rendezvous_timeout_s": 120.0},
            "nodes": entries}
    path = tmp / "cluster.toml"
    path.write_text(dumps(data))
    return path


def test_wait_worker_waits_for_every_worker_and_names_the_missing_one(tmp_path, serve):
    """Real worker supervisors (stand-in vLLM in the rendezvous) for w1 and w3 of three: the one
    missing keeps `dspark wait-worker` waiting, and it says which; once w2 joins it returns."""
    cluster = write_ring(tmp_path)
    for name in ("w1", "w3"):
        serve(cluster, name).read(until="READY=1")  # READY=1: its vLLM waits in the rendezvous
    # Bounded: it gives up naming w2 alone (w1 and w3 are where they should be).
    r = invoke_dspark("wait-worker", "--config", str(cluster), "--timeout", "2")
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    w2_url = C.load(cluster).node("w2").agent_url
    assert f"worker not ready after 2 s: w2 at {w2_url} is unreachable;" in r.stderr, r.stderr
    assert "w1" not in r.stderr and "w3" not in r.stderr
    # Unbounded but for the file's worker_wait_timeout_s: it waits, saying for whom (STATUS=).
    sock_path = str(tmp_path / "wait-worker-notify.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(sock_path)
        sock.settimeout(0.5)
        waiter = subprocess.Popen(dspark_cmd("wait-worker", "--config", str(cluster)), stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, env={**os.environ, "NOTIFY_SOCKET": sock_path})
        try:
            statuses: list[str] = []
            alone = "STATUS=waiting for w2 to enter the rendezvous"

            def waiting() -> list[str]:
                return [m for m in statuses if "waiting for" in m]

            # Three rounds or more (a second or more: still waiting), the last naming w2 alone. On a
            # loaded host a round may also name w1 or w3, whose agent did not answer in time then:
            # not ready as far as that round could tell, which is what it says.
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not (len(waiting()) >= 3 and waiting()[-1].startswith(alone)):
                try:
                    statuses.append(sock.recv(4096).decode())
                except TimeoutError:
                    pass
            assert len(waiting()) >= 3 and waiting()[-1].startswith(alone), statuses
            assert all("w2" in m for m in waiting()), waiting()  # never without the one missing
            assert waiter.poll() is None
            serve(cluster, "w2").read(until="READY=1")
            out, err = waiter.communicate(timeout=30)
        finally:
            if waiter.poll() is None:
                waiter.kill()
                waiter.communicate()
    assert waiter.returncode == 0, err
    assert out.strip() == "ready: w1 rendezvous, w2 rendezvous, w3 rendezvous"
