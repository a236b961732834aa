"""`dspark status` and `dspark wait-worker` when a peer's agent answers JSON that is not an
object (issue 12, item 3): the node shows as unreachable, never a traceback."""

from __future__ import annotations

import json

import pytest

from dspark import config as C
from hostile import HostileServer, answer
from pairlib import run_dspark


def port(server) -> int:
    return int(server.url.rsplit(":", 1)[1])


def cluster_for(tmp_path, worker_port: int, head_port: int, api_port: int):
    data = {"model": {"path": str(tmp_path), "served_name": "m"},
            "serving": {"tensor_parallel_size": 2, "speculative_config": {}},
            "nodes": [{"name": "h", "rank": 0, "address": "127.0.0.1", "api_host": "127.0.0.1", "api_port": api_port,
                       "agent_port": head_port},
                      {"name": "w", "rank": 1, "address": "127.0.0.2", "agent_port": worker_port}]}
    path = tmp_path / "cluster.toml"
    path.write_text(C.dumps(data))
    return path


@pytest.mark.parametrize("body", [b"[1, 2]", b'"x"', b"null", b"7"])
def test_status_and_wait_worker_with_a_non_object_agent(tmp_path, body):
    routes = {"/state": answer(body), "/version": answer(body), "/health": answer(b"")}
    with HostileServer(routes, host="127.0.0.2") as worker, HostileServer(routes) as head, \
            HostileServer(routes) as api:
        path = cluster_for(tmp_path, port(worker), port(head), port(api))
        r = run_dspark("status", "--config", str(path), "--json", timeout=60)
        assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
        snap = json.loads(r.stdout)
        assert [n["state"] for n in snap["nodes"]] == ["unreachable", "unreachable"]
        r = run_dspark("wait-worker", "--config", str(path), "--timeout", "1", timeout=60)
        assert r.returncode == 1 and "Traceback" not in r.stderr and "is unreachable" in r.stderr, r.stderr
