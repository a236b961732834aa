"""`dspark status`, `dspark wait-worker` and a serving worker's supervisor when a peer's agent
answers JSON that is not an object: the node shows as unreachable, never a
traceback; a worker whose head turns to such answers leaves the pair as from a silent head."""

from __future__ import annotations

import json
import time

import pytest

from dspark.config import validate as C
from dspark.config.template import dumps
from dspark.node.policy import EXIT_DIED
from tests.harness.dspark_cli import invoke_dspark
from tests.harness.hostile import HostileServer, answer, send
from tests.harness.standin import alive, write_cluster


def port(server) -> int:
    return int(server.url.rsplit(":", 1)[1])


def cluster_for(tmp_path, worker_port: int, head_port: int, api_port: int):
    data = {"model": {"path": str(tmp_path), "served_name": "m"},
            "serving": {"tensor_parallel_size": 2, "speculative_config": {}},
            "nodes": [{"name": "h", "rank": 0, "address": "127.0.0.1", "api_host": "127.0.0.1", "api_port": api_port,
                       "agent_port": head_port},
                      {"name": "w", "rank": 1, "address": "127.0.0.2", "agent_port": worker_port}]}
    path = tmp_path / "cluster.toml"
    path.write_text(dumps(data))
    return path


@pytest.mark.parametrize("body", [b"[1, 2]", b'"x"', b"null", b"7"])
def test_status_and_wait_worker_with_a_non_object_agent(tmp_path, body):
    routes = {"/state": answer(body), "/version": answer(body), "/health": answer(b"")}
    with HostileServer(routes, host="127.0.0.2") as worker, HostileServer(routes) as head, \
            HostileServer(routes) as api:
        path = cluster_for(tmp_path, port(worker), port(head), port(api))
        r = invoke_dspark("status", "--config", str(path), "--json")
        assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
        snap = json.loads(r.stdout)
        assert [n["state"] for n in snap["nodes"]] == ["unreachable", "unreachable"]
        r = invoke_dspark("wait-worker", "--config", str(path), "--timeout", "1")
        assert r.returncode == 1 and "Traceback" not in r.stderr and "is unreachable" in r.stderr, r.stderr


@pytest.mark.parametrize("body", [b"[1, 2]", b'"x"', b"null"])
def test_a_serving_worker_whose_head_turns_to_non_objects_leaves_the_pair_cleanly(tmp_path, serve, body):
    cluster = write_cluster(tmp_path, nodes=2)  # head_lost_s = 2
    head = C.load(cluster).node("h")
    reply = {"body": json.dumps({"state": "serving", "node": "h", "rank": 0}).encode()}
    routes = {"/state": lambda h: send(h, 200, reply["body"]), "/version": lambda h: send(h, 200, reply["body"])}
    with HostileServer(routes, host=head.address, port=head.agent_port):  # the head's agent
        w = serve(cluster, "w")  # the worker's real supervisor, with the stand-in vLLM
        w.read(until="READY=1")
        deadline = time.monotonic() + 20
        while w.state()["state"] != "serving" and time.monotonic() < deadline:
            time.sleep(0.2)
        assert w.state()["state"] == "serving"  # it follows the head it sees
        pid = w.state()["vllm_pid"]
        reply["body"] = body  # the head's agent now answers JSON that is not a state
        rc = w.wait(timeout=30)
        out = w.proc.stdout.read()
    assert "Traceback" not in out, out
    assert rc == EXIT_DIED, (rc, out[-2000:])
    assert "pair broken" in w.messages[-1] and "unreachable" in w.messages[-1], w.messages[-3:]
    assert not alive(pid)
