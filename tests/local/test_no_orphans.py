"""A fault on the real local pair, once: kill -9 of the worker's vLLM while requests run.
Every process of each node's vLLM run (vLLM's API process, `VLLM::EngineCore`,
`VLLM::Worker_TP*`: one process group) is gone before its supervisor exits and nothing of it
holds a listening port; the head leaves the broken pair at once (not after the drain); the
clients get errors, not hangs; the dashboard in Chromium shows the worker failed within 5 s.
One pair serves all of it: the kill is what every check watches.

The same sweep after the other ways a run ends (kill -9 of the head's vLLM, kill -9 of a
supervisor with requests in flight) is proven on the stand-in vLLM, whose run is also a process
group with a grandchild in it (tests/node/test_supervisor_signals.py); the policy's decisions on a
fake clock (tests/local/test_drain.py, tests/node/test_node_policy.py).

The run's processes are counted by the process group each vLLM leads (the PIDs the pair's
agents report); only processes of those groups, which this test's pair started, are killed."""

from __future__ import annotations

import os
import signal
import time

import pytest

from dspark.local import cluster as L
from dspark.node.vllm_process import group_members
from tests.harness.browser import wait_for
from tests.harness.dashboard import DashboardProcess

pytestmark = [pytest.mark.pair, pytest.mark.browser]


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


HEAD_GONE_S = 30.0  # the stop of a broken pair (not the drain, 60 s): the bound the fault test held
SHOWN_S = 5.0       # the dashboard shows a failed node within 5 s (docs/dashboard.md)
IN_FLIGHT = 6


def test_kill_9_of_the_workers_vllm_under_load_stops_the_pair_at_once_and_leaves_nothing(
        fresh_pair, browser, tmp_path, artifacts_dir):
    """Changes its pair: the kill breaks it (hence a pair of its own)."""
    from tests.local.test_drain import Clients, running  # the drain test's clients (status, tokens, finish reason)

    pair = fresh_pair
    dash = DashboardProcess(pair.cluster_file, tmp_path / "dashboard.log")
    try:
        dash.wait_ready()
        browser.get(dash.url)
        wait_for(browser, lambda p: p["nodes"].get(L.WORKER_NAME, {}).get("state") == "serving", timeout=30)
        sup, pgid, _ = run_of(pair, L.WORKER_NAME)
        head_sup, head_pgid, head_members = run_of(pair, L.HEAD_NAME)
        assert pair.ports.api in listening_ports(head_members)
        clients = Clients(pair.api_url, IN_FLIGHT, 3000)  # far longer than any stop: lost either way
        assert wait_until(lambda: running(pair.api_url) >= IN_FLIGHT, 60, step=0.2), running(pair.api_url)
        t0 = time.monotonic()
        os.kill(pgid, signal.SIGKILL)  # the worker's vLLM API process exits unasked: the pair is broken
        page = wait_for(browser, lambda p: p["nodes"][L.WORKER_NAME]["state"] == "failed", timeout=15, poll=0.1)
        shown = time.monotonic() - t0
        browser.save_screenshot(str(artifacts_dir / "dashboard-worker-failed.png"))
        # The worker's supervisor sweeps its vLLM's group before it exits.
        left, ports = left_when_supervisor_exits(sup, pgid)
        assert left == [] and ports == set(), (left, ports)
        # The head leaves the broken pair at once and stops its own vLLM: nothing of its run is left.
        left, ports = left_when_supervisor_exits(head_sup, head_pgid, timeout=120)
        head_gone = time.monotonic() - t0
        assert left == [] and ports == set(), (left, ports)
        clients.join(timeout=60)
    finally:
        dash.stop()
    print(f"worker shown failed {shown:.2f} s after kill -9 of its vLLM ({page['nodes'][L.WORKER_NAME]['detail']}); "
          f"head supervisor gone after {head_gone:.1f} s; clients {clients.results}")
    assert shown <= SHOWN_S, f"the page showed the worker failed after {shown:.1f} s"
    assert page["pair"] == "NOT SERVING"
    assert all(not t.is_alive() for t in clients.threads), clients.results  # errors, not hangs
    assert len(clients.results) == IN_FLIGHT and not any(r[0] == 200 and r[2] == "length"
                                                        for r in clients.results.values()), clients.results
    assert head_gone < HEAD_GONE_S, head_gone
