"""dspark check: ports (real sockets on loopback), the peers (a real node agent), this node's
identity, the command line (`dspark check`, `dspark serve --check`) and `dspark local up`."""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dspark.config import validate as C
from dspark.config.schema import Cluster, NodeConfig, ServingConfig
from dspark.config.template import dumps
from dspark.local.appliance import up
from dspark.local.cluster import LocalError, LocalPorts, prepare
from dspark.local.model import TINY_MODEL
from dspark.node import states as S
from dspark.node.agent import Agent
from dspark.preflight import Host
from dspark.preflight import node_identity as NI
from dspark.preflight import peer as P
from dspark.preflight import ports as PO
from tests.harness.dspark_cli import invoke_dspark
from tests.harness.pair import run_dspark


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def cluster(tmp_path: Path, head_agent: int, worker_agent: int, **head) -> Cluster:
    path = tmp_path / "cluster.toml"
    (tmp_path / "model").mkdir(exist_ok=True)
    (tmp_path / "model" / "config.json").write_text(json.dumps(TINY_MODEL))
    data = {"model": {"path": str(tmp_path / "model")},
            "serving": {"vllm_command": [sys.executable, "-m", "vllm.entrypoints.cli.main"], "load_format": "dummy"},
            "nodes": [{"name": "h", "rank": 0, "address": "127.0.0.1", "agent_port": head_agent,
                       "api_host": "127.0.0.1", "api_port": free_port(), "master_port": free_port(), **head},
                      {"name": "w", "rank": 1, "address": "127.0.0.2", "agent_port": worker_agent}]}
    path.write_text(dumps(data))
    return C.load(path)


def by_name(checks):
    return {c.name: c for c in checks}


# ------------------------------------------------------------------------------ ports
def test_free_ports(tmp_path):
    c = cluster(tmp_path, free_port(), free_port())
    got = by_name(PO.check_ports(c, c.head, Path("/proc"), None))
    assert set(got) == {"port.agent", "port.master", "port.api"}
    assert all(x.status == "ok" and "is free" in x.seen for x in got.values())


def test_port_held_by_another_process_names_it(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        c = cluster(tmp_path, port, free_port())
        got = by_name(PO.check_ports(c, c.head, Path("/proc"), None))["port.agent"]
        assert got.status == "fail" and f"pid {os.getpid()}" in got.seen and "another agent_port" in got.fix


def test_port_held_by_this_nodes_own_agent(tmp_path):
    port = free_port()
    c = cluster(tmp_path, port, free_port())
    state = S.NodeState(node="h", rank=0, role="head", state=S.SERVING)
    agent = Agent("127.0.0.1", port, state.snapshot).start()
    try:
        own = P.own_agent_state(c.head)
        assert own is not None and own["node"] == "h"
        got = by_name(PO.check_ports(c, c.head, Path("/proc"), own))["port.agent"]
        assert got.status == "ok" and "this node's own" in got.seen
        # The same port held by an agent answering as another node is not ours.
        c2 = cluster(tmp_path, port, free_port())
        other = NodeConfig(name="x", rank=0, address="127.0.0.1", agent_port=port)
        assert P.own_agent_state(other) is None
        assert by_name(PO.check_ports(c2, c2.head, Path("/proc"), None))["port.agent"].status == "fail"
    finally:
        agent.stop()


LISTENER = ("import socket, sys, time; s = socket.socket(); s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(); "
            "print('up', flush=True); time.sleep(60)")


def listener(host: str, port: int, *argv: str) -> subprocess.Popen:
    """A real process listening on host:port whose command line ends in `argv`."""
    p = subprocess.Popen([sys.executable, "-c", LISTENER, host, str(port), *argv], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "up"
    return p


def stop(p: subprocess.Popen) -> None:
    p.kill()
    p.wait()
    p.stdout.close()


def test_port_owner_is_matched_by_address_and_node(tmp_path):
    port = free_port()
    c = cluster(tmp_path, port, free_port())
    # A dspark serve of this node's name on another address with the same port, and a stranger
    # on this node's address: the stranger is the one in the way.
    ours_elsewhere = listener("127.0.0.2", port, "dspark", "serve", "--node", "h")
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
            s.listen()
            got = by_name(PO.check_ports(c, c.head, Path("/proc"), None))["port.agent"]
            assert got.status == "fail" and f"pid {os.getpid()}" in got.seen
    finally:
        stop(ours_elsewhere)
    for node, want in (("h", "ok"), ("w", "fail")):
        p = listener("127.0.0.1", port, "dspark", "serve", "--node", node)
        try:
            got = by_name(PO.check_ports(c, c.head, Path("/proc"), None))["port.agent"]
        finally:
            stop(p)
        assert got.status == want, got
        if want == "ok":
            assert f"dspark serve (pid {p.pid})" in got.seen


def test_address_not_on_this_host(tmp_path):
    c = cluster(tmp_path, free_port(), free_port(), agent_host="192.0.2.123")
    got = by_name(PO.check_ports(c, c.head, Path("/proc"), None))["port.agent"]
    assert got.status == "fail" and "not an address of this host" in got.seen


# ------------------------------------------------------------------------------ identity
def test_identity_of_this_checkout(tmp_path):
    c = cluster(tmp_path, free_port(), free_port())
    ident = NI.local_identity(c)
    assert ident["cluster_sha256"] == hashlib.sha256(Path(c.source).read_bytes()).hexdigest()
    assert ident["vllm_version"].startswith("0.28.0")  # the venv's real vLLM CPU build
    assert len(ident["vllm_sources_sha256"]) == 64 and ident["vllm_sources_files"] > 1000
    assert NI.local_identity(c) == ident  # stable
    c2 = Cluster(model=c.model, serving=ServingConfig(vllm_command=["/nonexistent/vllm"]), nodes=c.nodes,
                   source=c.source)
    assert "error" in NI.runtime_identity(c2.serving.vllm_command)


def test_runtime_python_from_the_venvs_vllm_script():
    vllm = Path(sys.executable).parent / "vllm"
    if not vllm.exists():
        pytest.skip("no vllm entry point beside this Python")
    assert Path(NI._runtime_python([str(vllm)])).name.startswith("python")


def test_model_fingerprint_changes_with_a_shard(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text("{}")
    (d / "a.safetensors").write_bytes(b"x" * 10)
    before = NI.model_fingerprint(str(d))
    (d / "a.safetensors").write_bytes(b"x" * 9)  # truncated
    assert NI.model_fingerprint(str(d)) != before


# ------------------------------------------------------------------------------ peers
class FakeClockState(S.NodeState):
    """A real node state whose clock is off by `skew` seconds."""

    skew = 0.0

    def snapshot(self) -> dict:
        d = super().snapshot()
        d["time"] += self.skew
        return d


def serve_agent(port: int, name: str, identity: dict | None, skew: float = 0.0) -> Agent:
    state = FakeClockState(node=name, rank=1, role="worker", state=S.RENDEZVOUS, identity=identity)
    state.skew = skew
    return Agent("127.0.0.2", port, state.snapshot).start()


MINE = {"cluster_sha256": "a" * 64, "model_sha256": "b" * 64, "vllm_version": "0.28.0",
        "vllm_sources_sha256": "c" * 64}


def test_peer_with_the_same_identity(tmp_path):
    port = free_port("127.0.0.2")
    c = cluster(tmp_path, free_port(), port)
    agent = serve_agent(port, "w", dict(MINE))
    try:
        got = by_name(P.check_peers(c, c.head, dict(MINE)))
    finally:
        agent.stop()
    assert {k: v.status for k, v in got.items()} == {
        "peer.w.cluster": "ok", "peer.w.model": "ok", "peer.w.runtime": "ok", "peer.w.clock": "ok"}
    assert "vLLM 0.28.0" in got["peer.w.runtime"].seen


def test_peer_with_another_cluster_file_runtime_and_clock(tmp_path):
    port = free_port("127.0.0.2")
    c = cluster(tmp_path, free_port(), port)
    theirs = dict(MINE, cluster_sha256="d" * 64, vllm_sources_sha256="e" * 64)
    agent = serve_agent(port, "w", theirs, skew=5.0)
    try:
        got = by_name(P.check_peers(c, c.head, dict(MINE)))
    finally:
        agent.stop()
    assert got["peer.w.cluster"].status == "fail" and "same cluster file" in got["peer.w.cluster"].fix
    assert got["peer.w.model"].status == "ok"
    assert got["peer.w.runtime"].status == "fail"
    assert got["peer.w.clock"].status == "warn"
    # The offset is measured against the midpoint of the round trip, so on a loaded host it
    # reads 5 s give or take half the round trip the same line reports (e.g. "+4.999").
    m = re.search(r"clock is ([+-][0-9.]+) s from this node's \(round trip ([0-9.]+) s\)",
                  got["peer.w.clock"].seen)
    assert m, got["peer.w.clock"].seen
    assert abs(float(m[1]) - 5.0) <= float(m[2]) / 2 + 0.002, got["peer.w.clock"].seen


def test_unreachable_peers(tmp_path):
    c = cluster(tmp_path, free_port(), free_port("127.0.0.2"))
    [c_head] = P.check_peers(c, c.head, dict(MINE))  # the head expects the worker up
    assert c_head.status == "warn" and "does not answer" in c_head.seen
    [c_worker] = P.check_peers(c, c.workers[0], dict(MINE), starting=True)  # the worker starts first
    assert c_worker.status == "ok" and "starts after the workers" in c_worker.seen
    [c_worker] = P.check_peers(c, c.workers[0], dict(MINE))  # on demand: the head should answer
    assert c_worker.status == "warn" and "does not answer" in c_worker.seen


def test_peer_without_identity_warns(tmp_path):
    port = free_port("127.0.0.2")
    c = cluster(tmp_path, free_port(), port)
    agent = serve_agent(port, "w", None)
    try:
        got = by_name(P.check_peers(c, c.head, dict(MINE)))
    finally:
        agent.stop()
    assert got["peer.w"].status == "warn" and "no identity" in got["peer.w"].seen


# ------------------------------------------------------------------------------ command line
def test_dspark_check_on_this_host(tmp_path):
    c = cluster(tmp_path, free_port(), free_port("127.0.0.2"))
    r = invoke_dspark("check", "--config", c.source, "--node", "w", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads(r.stdout)
    got = {x["name"]: x for x in report["checks"]}
    assert report["ok"] is True and got["gpu"]["status"] in ("warn", "ok")
    if got["gpu"]["status"] == "warn":  # this machine has no GPU: said so, with a reason
        assert "no NVIDIA driver" in got["gpu"]["seen"]
    assert report["identity"]["vllm_version"].startswith("0.28.0")
    r = invoke_dspark("check", "--config", c.source, "--node", "w")
    last = r.stdout.splitlines()[-1]
    assert r.returncode == 0 and last.startswith("w: ") and " checks, 0 failed" in last
    assert any(line.startswith("ok    port.agent") for line in r.stdout.splitlines())


def test_memory_check_without_a_readable_plan_warns(tmp_path):
    from dspark.preflight import run

    c = cluster(tmp_path, free_port(), free_port("127.0.0.2"))
    (tmp_path / "model" / "config.json").write_text('{"num_hidden_layers": 2}')  # no attention shape
    report = run(c, c.workers[0], Host(peers=False, identity={}))
    got = by_name(report.checks)["memory.free"]
    assert got.status == "warn" and "the plan cannot read" in got.seen


def test_dspark_check_fails_with_a_clear_message(tmp_path):
    c = cluster(tmp_path, free_port(), free_port("127.0.0.2"))
    (tmp_path / "model" / "config.json").unlink()
    r = invoke_dspark("check", "--config", c.source, "--node", "w", "--no-peers")
    assert r.returncode == 1
    assert "fail  model.dir" in r.stdout and "no config.json" in r.stdout and "Traceback" not in r.stdout + r.stderr
    r = invoke_dspark("check", "--config", str(tmp_path / "missing.toml"), "--node", "w")
    assert r.returncode == 2 and "file not found" in r.stderr and "Traceback" not in r.stderr


def test_serve_check_refuses_before_vllm_with_exit_2(tmp_path):
    c = cluster(tmp_path, free_port(), free_port("127.0.0.2"))
    (tmp_path / "model" / "config.json").unlink()
    r = run_dspark("serve", "--config", c.source, "--node", "w", "--check", timeout=60)
    assert r.returncode == 2
    last = r.stderr.strip().splitlines()[-1]  # the last journal line under systemd
    assert last.startswith("refusing to start: dspark check failed: model.dir") and "fix:" in last
    assert "check fail  model.dir" in r.stderr and "starting vLLM" not in r.stderr


def test_local_up_stops_before_spawning_on_a_failed_check(tmp_path):
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "meminfo").write_text("MemTotal: 1024 kB\nMemAvailable: 1024 kB\n")
    lines: list[str] = []
    ports = LocalPorts(api=free_port(), master=free_port(), agent=free_port())
    t0 = time.monotonic()
    with pytest.raises(LocalError) as e:
        up(tmp_path / "local", ports, progress=lines.append, check_host=Host(proc=proc))
    assert "dspark check failed for local-worker: memory.free" in str(e.value)
    assert not any(line.startswith("starting the worker") for line in lines)
    assert any("check fail: memory.free" in line for line in lines)
    assert time.monotonic() - t0 < 60
    assert not (tmp_path / "local" / "logs").exists()  # nothing was spawned


def test_prepare_of_local_still_validates(tmp_path):
    path = prepare(tmp_path / "l", LocalPorts(api=free_port(), master=free_port(), agent=free_port()))
    assert C.load(path).head.name == "local-head"


def test_node_units_run_the_check_before_vllm():
    from dspark.units.names import HEAD, WORKER
    from dspark.units.render import render_units

    units = render_units("/usr/bin/dspark")
    for name, role in ((WORKER, "worker"), (HEAD, "head")):
        [start] = [line for line in units[name].splitlines() if line.startswith("ExecStart=")]
        assert start == f"ExecStart=/usr/bin/dspark serve --check --state-dir %S/dspark/{role}"
        assert "RestartPreventExitStatus=2" in units[name]  # a refused start is not retried
