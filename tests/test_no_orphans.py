"""No orphan, ever, on the real local pair: whatever ends a vLLM run, every
process of that run (vLLM's API process, `VLLM::EngineCore`, `VLLM::Worker_TP*`: one process
group) is gone before its supervisor exits, and nothing of it holds a listening port.

The run's processes are counted by the process group each vLLM leads (the PIDs the pair's
agents report); only processes of those groups, which this test's pair started, are killed."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request

import pytest

from dspark import local as L
from dspark.vllm_process import group_members

pytestmark = pytest.mark.pair

GONE_S = 30.0  # generous: the sweep takes well under a second, a loaded 2-core host more


def listening_ports(pids: list[int]) -> set[int]:
    """The TCP ports on which any of `pids` listens."""
    inodes = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:
            continue
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            f = row.split()
            if len(f) > 9 and f[3] == "0A" and f[9] in inodes:  # 0A: LISTEN
                ports.add(int(f[1].rsplit(":", 1)[1], 16))
    return ports


def supervisor_pid(pair, node: str) -> int:
    """The pid of `node`'s supervisor: the child of `local up` serving that node."""
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read().rsplit(b")", 1)[1].split()
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmd = f.read().split(b"\0")
        except (OSError, IndexError):
            continue
        if int(stat[1]) == pair.proc.pid and b"serve" in cmd and node.encode() in cmd:
            return int(name)
    raise AssertionError(f"no supervisor of {node} under local up ({pair.proc.pid})")


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return False


def wait_until(cond, timeout: float, step: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(step)
    return cond()


def run_of(pair, node: str) -> tuple[int, int, list[int]]:
    """`node`'s supervisor pid, its vLLM's process group and that group's processes now."""
    pgid = pair.state(node)["vllm_pid"]
    pair.groups.add(pgid)  # swept at teardown, whatever happens here
    members = group_members(pgid)
    assert len(members) >= 3, members  # the API process, the engine core, a TP worker (and dspark's reaper)
    return supervisor_pid(pair, node), pgid, members


def left_when_supervisor_exits(sup: int, pgid: int, timeout: float = 120) -> tuple[list[int], set[int]]:
    """Wait for the supervisor `sup` to exit; the group's processes and their listening ports
    at that moment (none: it swept its vLLM before exiting)."""
    assert wait_until(lambda: not alive(sup), timeout, step=0.02), f"supervisor {sup} still running"
    left = group_members(pgid)
    return left, listening_ports(left)


def test_kill_9_of_the_heads_vllm_leaves_nothing(fresh_pair):
    sup, pgid, members = run_of(fresh_pair, "local-head")
    assert fresh_pair.ports.api in listening_ports(members)
    os.kill(pgid, signal.SIGKILL)  # vLLM's API process exits unasked
    left, ports = left_when_supervisor_exits(sup, pgid)
    assert left == [] and ports == set(), (left, ports)


def test_kill_9_of_the_workers_vllm_leaves_nothing(fresh_pair):
    sup, pgid, _ = run_of(fresh_pair, "local-worker")
    _, head_pgid, _ = run_of(fresh_pair, "local-head")
    head_sup = supervisor_pid(fresh_pair, "local-head")
    os.kill(pgid, signal.SIGKILL)
    left, ports = left_when_supervisor_exits(sup, pgid)
    assert left == [] and ports == set(), (left, ports)
    # The head leaves the broken pair and stops its own vLLM: nothing of its run is left either.
    left, ports = left_when_supervisor_exits(head_sup, head_pgid)
    assert left == [] and ports == set(), (left, ports)


def test_kill_9_of_the_heads_supervisor_takes_its_vllm_down_and_clients_get_errors(fresh_pair):
    sup, pgid, _ = run_of(fresh_pair, "local-head")
    ended: list[str] = []

    def client(i: int) -> None:
        body = json.dumps({"model": L.SERVED_NAME, "prompt": [1 + i, 2, 3], "max_tokens": 3000,
                           "ignore_eos": True}).encode()
        req = urllib.request.Request(fresh_pair.api_url + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=300) as r:
                r.read()
            ended.append("done")
        except (urllib.error.URLError, OSError, ValueError) as e:
            ended.append(type(e).__name__)

    clients = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(4)]
    for t in clients:
        t.start()
    time.sleep(3)  # the requests are in flight
    os.kill(sup, signal.SIGKILL)  # the supervisor dies without a word
    t0 = time.monotonic()
    gone = wait_until(lambda: not group_members(pgid), GONE_S)
    took = time.monotonic() - t0
    left = group_members(pgid)
    assert gone and left == [], (left, listening_ports(left))
    for t in clients:  # errors, not hangs
        t.join(timeout=GONE_S)
    assert len(ended) == 4 and not any(t.is_alive() for t in clients), ended
    print(f"vLLM group gone {took:.1f} s after kill -9 of the supervisor; clients: {ended}")
