"""`dspark serve`'s one startup path (dspark.node.startup): what ends a start before the
supervisor (the API key, the memory plan) and what a start is given (the state directory, the
line this node runs, with the one warning when its state names a line the file cannot run),
through `startup` itself, on real cluster files and state directories. And a Supervisor is
built without touching the host: the RoCE GID is looked up when vLLM is launched."""

from __future__ import annotations

import io
import sys
import threading
import tomllib
from pathlib import Path

import pytest

from dspark.config import validate as C
from dspark.config.template import dumps
from dspark.lines import state as line_state
from dspark.node import supervisor as supervisor_module
from dspark.node.policy import EXIT_CONFIG
from dspark.node.signals import SignalQueue
from dspark.node.startup import Plan, Refusal, running_line, startup
from dspark.node.supervisor import Supervisor
from tests.harness.standin import STANDIN, write_cluster

A, B = "v0.28.0", "v0.32.0"  # the file's line, and another installed one


def cluster_with(tmp_path: Path, **node: object):
    path = write_cluster(tmp_path)
    data = tomllib.loads(path.read_text())
    data["serving"]["runtime_line"] = A
    data["serving"]["line_commands"] = {A: [sys.executable, str(STANDIN)], B: [sys.executable, str(STANDIN)]}
    data["nodes"][0].update(node)
    path.write_text(dumps(data))
    return C.load(path)


def start(cluster, state_dir, **kw) -> Plan | Refusal:
    args = dict(state_dir=state_dir, signals=SignalQueue(), say=lambda line: None, gate=None,
                identity=lambda c: {"node": "h"}, skip_plan=True)
    return startup(cluster, cluster.head, **{**args, **kw})


def test_a_head_whose_key_file_gives_no_key_is_refused_with_exit_2(tmp_path, monkeypatch):
    cluster = cluster_with(tmp_path)
    monkeypatch.delenv("CREDENTIALS_DIRECTORY", raising=False)
    monkeypatch.setenv("DSPARK_API_KEY_FILE", str(tmp_path / "missing-key"))
    out = start(cluster, None)
    assert isinstance(out, Refusal) and (out.code, out.retry) == (EXIT_CONFIG, False), out
    assert out.message.startswith(f"refusing to start: the API key file {tmp_path / 'missing-key'} ")
    assert "does not exist" in out.message
    (tmp_path / "missing-key").write_text("k3y\n")
    assert isinstance(start(cluster, None), Plan)


def test_a_plan_that_cannot_be_made_refuses_the_start_and_skip_plan_starts_it(tmp_path):
    cluster = cluster_with(tmp_path)  # its model directory holds no config.json: no plan
    out = start(cluster, None, skip_plan=False)
    assert isinstance(out, Refusal) and out.code == EXIT_CONFIG and not out.retry, out
    assert out.message.startswith("refusing to start: plan: "), out.message
    plan = start(cluster, None, skip_plan=True)
    assert isinstance(plan, Plan) and plan.identity == {"node": "h"}
    plan.notify.close()


@pytest.mark.parametrize("given, used", [("{d}/state", "{d}/state"), ("{d}/state:{d}/other", "{d}/state"),
                                         (None, None)])
def test_the_state_directory_is_the_first_of_systemds_list(tmp_path, given, used):
    cluster = cluster_with(tmp_path)
    plan = start(cluster, given and given.format(d=tmp_path))
    assert isinstance(plan, Plan)
    assert plan.state_dir == (Path(used.format(d=tmp_path)) if used else None)
    plan.notify.close()


def test_the_line_is_the_states_when_installed_else_the_files_with_one_warning(tmp_path, capfd):
    cluster = cluster_with(tmp_path)
    state = tmp_path / "state"
    state.mkdir()
    assert running_line(cluster, state)[:1] == (A,) and running_line(cluster, state).warning is None
    line_state.write(state, line_state.LineState(B, A))  # dspark switch moved the pair to B
    line, on_line, warning = running_line(cluster, state)
    assert (line, on_line.serving.runtime_line, warning) == (B, B, None)

    line_state.write(state, line_state.LineState("v0.99.0", A))  # a line this file does not install
    line, on_line, warning = running_line(cluster, state)
    assert (line, on_line.serving.runtime_line) == (A, A)
    assert warning is not None and "runtime line 'v0.99.0' is not installed" in warning
    assert warning.endswith(f"; running the cluster file's line {A}")

    capfd.readouterr()
    plan = start(cluster, state)  # the checks and the plan see the file's line, and the log says why once
    assert isinstance(plan, Plan) and plan.line == (line, on_line, warning)
    err = capfd.readouterr().err
    assert [ln for ln in err.splitlines() if "not installed" in ln] == [f"dspark[h]: {warning}"], err
    plan.notify.close()


def stop(sup: Supervisor) -> None:
    """As the supervisor's exit does: vLLM's group swept; then its log pipe, read to its end, closed."""
    sup._stop_vllm("test done", at_once=True)
    for t in threading.enumerate():
        if t.name == "vllm-log":
            t.join(10)
    assert sup.vllm.proc is not None and sup.vllm.proc.stdout is not None
    sup.vllm.proc.stdout.close()


def test_constructing_a_supervisor_reads_no_gid_the_launch_does(tmp_path, monkeypatch):
    """`gid_index = "auto"` on an RDMA device: the GID is looked up when vLLM is launched (the
    index can change across a reboot), and never by the constructor."""
    calls: list[tuple[str, str]] = []

    def resolver(device: str, address: str, sysfs: Path = Path("/sys/class/infiniband")) -> str | None:
        calls.append((device, address))
        return None if len(calls) > 1 else "3"

    monkeypatch.setattr(supervisor_module, "resolve_gid_index", resolver)
    cluster = cluster_with(tmp_path, rdma_device="rocep1s0f0", gid_index="auto")
    log = io.StringIO()
    sup = Supervisor(cluster, cluster.head, env={}, log=log, count_start=False)
    assert calls == [] and "NCCL_IB_GID_INDEX" not in sup.vllm.launch.env
    sup._start_vllm()  # the launch step: the stand-in vLLM, a real process
    try:
        assert calls == [("rocep1s0f0", "127.0.0.1")]
        assert sup.vllm.launch.env["NCCL_IB_GID_INDEX"] == "3" and sup.vllm.pid is not None
    finally:
        stop(sup)
    # A second Supervisor (a switch's next run) looks it up again at its launch; none found is said.
    again = Supervisor(cluster, cluster.head, env={}, log=log, count_start=False)
    assert len(calls) == 1
    again._start_vllm()
    try:
        assert len(calls) == 2 and "NCCL_IB_GID_INDEX" not in again.vllm.launch.env
    finally:
        stop(again)
    assert "dspark[h]: no RoCE v2 GID for 127.0.0.1 on rocep1s0f0; NCCL picks one" in log.getvalue()
