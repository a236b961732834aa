"""Signals at the edges of `dspark serve`'s life, against the stand-in vLLM:
SIGHUP restarts the node through a failure exit, SIGTERM during the restart backoff keeps the
failure history, a SIGKILLed supervisor takes its vLLM's whole group with it, a vLLM killed
unasked leaves nothing of its group once the supervisor exits, and a
SIGINT in the first instants gives no traceback."""

import json
import os
import re
import signal
import subprocess
import time

import pytest

from dspark.node.policy import EXIT_DIED, EXIT_OK
from tests.harness.pair import dspark_cmd
from tests.harness.standin import alive, write_cluster


def test_sighup_stops_vllm_and_exits_as_a_failure_so_systemd_restarts_the_node(tmp_path, serve):
    s = serve(write_cluster(tmp_path), "h")
    s.read(until="READY=1")
    pid = s.state()["vllm_pid"]
    s.proc.send_signal(signal.SIGHUP)
    rc = s.wait()
    # Restart=on-failure restarts only a non-zero exit: 0 would leave the node down for good.
    assert rc == EXIT_DIED, (rc, s.messages[-3:])
    assert not alive(pid)
    assert "SIGHUP" in s.messages[-1] and "restart" in s.messages[-1], s.messages[-1]


def test_sigterm_during_the_restart_backoff_keeps_the_failure_history(tmp_path, serve):
    cluster = write_cluster(tmp_path)
    state_dir = tmp_path / "state-h"
    state_dir.mkdir()
    failures = state_dir / "failures.json"
    failures.write_text(json.dumps({"consecutive": 3, "last": "exit 4: liveness lost"}))
    s = serve(cluster, "h", INVOCATION_ID="test")  # backoff only under systemd
    s.read(until="backoff: 3 failed runs", timeout=15)
    s.proc.send_signal(signal.SIGTERM)
    assert s.wait() == EXIT_OK
    d = json.loads(failures.read_text())
    # Stopped before even starting: the three failures in a row still stand (the next start
    # waits again), and the run that never started is not counted as a fourth.
    assert d["consecutive"] == 3, d
    assert d["last"] == "exit 4: liveness lost", d


def listens(port: int) -> bool:
    import socket

    with socket.socket() as sock:
        sock.settimeout(2)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def test_a_sigkilled_supervisor_takes_its_vllms_whole_group_down_and_clients_get_errors(tmp_path, serve):
    """Outside systemd no KillMode= sweeps the group: the supervisor's own arrangements must. The
    stand-in's run is one process group with a grandchild in it, as vLLM's API process, engine
    core and TP workers are; requests are in flight when the supervisor dies."""
    from dspark.node.vllm_process import group_members
    from tests.node.test_supervisor import completions

    child_file = tmp_path / "grandchild.pid"
    s = serve(write_cluster(tmp_path), "h", STANDIN_CHILD_FILE=child_file, STANDIN_TOKEN_S=0.05)
    s.read(until="READY=1")
    pid = s.state()["vllm_pid"]
    grandchild = int(child_file.read_text())
    assert grandchild in group_members(pid)
    results, threads = completions(s.node.api_url, 4, max_tokens=3000, timeout=120)
    time.sleep(1.0)  # the requests are in flight (3000 tokens at 0.05 s each: minutes)
    s.proc.send_signal(signal.SIGKILL)
    s.proc.wait()
    deadline = time.monotonic() + 30  # generous: the sweep takes well under a second
    while group_members(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = group_members(pid)
    if left:
        os.killpg(pid, signal.SIGKILL)
    assert left == [] and not alive(pid) and not alive(grandchild), f"left of vLLM's group: {left}"
    assert not listens(s.node.api_port)
    for t in threads:  # errors, not hangs
        t.join(timeout=30)
    assert len(results) == 4 and not any(r == 200 for r in results), results


def test_kill_9_of_vllm_leaves_nothing_of_its_group_once_the_supervisor_exits(tmp_path, serve):
    """vLLM's API process killed unasked: the supervisor exits as a failure, and by then every
    process of the run (the grandchild too) is gone and nothing listens on the API port."""
    from dspark.node.vllm_process import group_members

    child_file = tmp_path / "grandchild.pid"
    s = serve(write_cluster(tmp_path), "h", STANDIN_CHILD_FILE=child_file)
    s.read(until="READY=1")
    pid = s.state()["vllm_pid"]
    grandchild = int(child_file.read_text())
    os.kill(pid, signal.SIGKILL)
    assert s.wait(timeout=60) == EXIT_DIED
    left = group_members(pid)  # at the moment the supervisor has exited
    if left:
        os.killpg(pid, signal.SIGKILL)
    assert left == [] and not alive(grandchild), left
    assert not listens(s.node.api_port)


@pytest.mark.parametrize("delay", [0.02, 0.05, 0.08, 0.11, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.6, 0.8])
def test_sigint_in_the_first_instants_gives_no_traceback(tmp_path, delay):
    cluster = write_cluster(tmp_path)
    proc = subprocess.Popen(dspark_cmd("serve", "--config", str(cluster), "--node", "h", "--skip-plan",
                                       "--state-dir", str(tmp_path / "state")),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "STANDIN_ENV_FILE": str(tmp_path / "env.json")},
                            # A terminal's Ctrl-C: SIGINT at its default, also when this test
                            # itself runs as a background job (where the shell ignores SIGINT).
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        time.sleep(delay)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # Python's own start (runpy, site) can be interrupted before dspark's first line runs:
    # no program can install a handler earlier. From dspark's first line on, no traceback.
    # A traceback is dspark's when one of its frames runs dspark's or click's code: the frames of
    # the import system finding dspark (whose messages may name the path of src/dspark) are not.
    tb = out[out.index("Traceback"):] if "Traceback" in out else ""
    frames = re.findall(r'^\s*File "([^"]+)"', tb, re.M)
    assert not [f for f in frames if "/dspark/" in f or "/click/" in f], out
    assert "Aborted" not in out, out
    if tb:
        return  # Python's own start was interrupted (it exits 1 then): before any dspark code
    # Stopped on request: exit 0 (handled) or death by SIGINT (before Python could handle it).
    assert proc.returncode in (EXIT_OK, -signal.SIGINT), (proc.returncode, out)
