"""Slow clients against the agent and the dashboard: 200 connections on
loopback that trickle their request a byte at a time take no handler slot; the servers keep
answering real requests, and a pair of real supervisors (stand-in vLLM) keeps serving for
3 x head_lost_s under that load."""

from __future__ import annotations

import socket
import time

import pytest

from dspark.dashboard import collector as C
from dspark.dashboard import server as S
from dspark.node.agent import Agent
from dspark.node.agent_client import fetch_state
from tests.harness.standin import write_cluster

pytestmark = pytest.mark.load

SLOW = 200
SNAP = {"node": "n", "rank": 0, "role": "head", "state": "serving", "restarts": 0, "uptime_s": 1.0,
        "vllm_pid": None, "vllm_version": None, "dspark_version": "0", "liveness": None}
REQUEST = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"


class Tricklers:
    """`n` connections to (host, port), each sending one more byte of a request on every
    `step()`, never finishing it; reconnecting when the server drops one. All closed at exit."""

    def __init__(self, host: str, port: int, n: int = SLOW):
        self.addr, self.n = (host, port), n
        self.socks: list[list] = []  # [socket, bytes sent]

    def __enter__(self) -> Tricklers:
        for _ in range(self.n):
            self.socks.append([self._connect(), 0])
        return self

    def _connect(self) -> socket.socket | None:
        try:
            s = socket.create_connection(self.addr, timeout=2)
            s.setblocking(False)
            return s
        except OSError:
            return None

    def step(self) -> None:
        for entry in self.socks:
            s, sent = entry
            try:
                if s is None:
                    raise OSError
                s.send(REQUEST[sent % (len(REQUEST) - 4):][:1])  # never the final blank line
                entry[1] = sent + 1
            except BlockingIOError:
                pass
            except OSError:
                if s is not None:
                    s.close()
                entry[0], entry[1] = self._connect(), 0

    def __exit__(self, *exc) -> None:
        for s, _ in self.socks:
            if s is not None:
                s.close()


def healthz(port: int) -> tuple[bool, float]:
    t0 = time.monotonic()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
            s.settimeout(10)
            data = b""
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    break
                data += chunk
    except OSError:
        return False, time.monotonic() - t0
    return b" 200 " in data, time.monotonic() - t0


def trickled(kind: str, seconds: float) -> dict:
    """`seconds` of 200 trickling connections against a fresh agent or dashboard: every 0.3 s
    one more byte on each, a /healthz (ok, seconds) and, from the agent, a fetch_state answer;
    the host's time for one /healthz before the load as `base`."""
    if kind == "agent":
        srv = Agent("127.0.0.1", 0, lambda: SNAP).start()
    else:
        srv = S.DashboardServer("127.0.0.1", 0, C.Collector(C.Targets("http://127.0.0.1:1", ()), timeout_s=0.2)).start()
    out = {"healthz": [], "fetch_state": []}
    try:
        out["base"] = max(healthz(srv.port)[1] for _ in range(5))  # this host's time for one answer, unloaded
        with Tricklers("127.0.0.1", srv.port) as slow:
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                slow.step()
                out["healthz"].append(healthz(srv.port))
                if kind == "agent":
                    out["fetch_state"].append(fetch_state(f"http://127.0.0.1:{srv.port}", timeout=2.0))
                time.sleep(0.3)
    finally:
        srv.stop()
    return out


@pytest.fixture(scope="module")
def under_slow_clients():
    """One 25 s window of slow clients per server, shared by the tests that read it (past the
    old per-read timeout, 10 s, and the request deadline)."""
    runs: dict[str, dict] = {}

    def run(kind: str) -> dict:
        if kind not in runs:
            runs[kind] = trickled(kind, 25)
        return runs[kind]

    return run


@pytest.mark.parametrize("kind", ["agent", "dashboard"])
def test_200_slow_clients_take_no_slot(under_slow_clients, kind):
    run = under_slow_clients(kind)
    results, base = run["healthz"], run["base"]
    failed = [r for r in results if not r[0]]
    assert len(results) >= 10 and not failed, (len(failed), len(results))
    worst = max(t for _, t in results)
    assert worst < max(5.0, 50 * base), (worst, base)


def test_the_agent_answers_fetch_state_under_200_slow_clients(under_slow_clients):
    answers = under_slow_clients("agent")["fetch_state"]
    bad = [a.error for a in answers if a.state is None]
    assert answers and not bad, bad[:3]


def test_a_serving_pair_keeps_serving_for_3_head_lost_s_under_slow_clients(tmp_path, serve):
    cluster = write_cluster(tmp_path, nodes=2)  # head_lost_s = 2
    w = serve(cluster, "w")
    w.read(until="READY=1")
    h = serve(cluster, "h")
    h.read(until="READY=1")
    deadline = time.monotonic() + 30
    while w.state()["state"] != "serving" and time.monotonic() < deadline:
        time.sleep(0.2)
    assert w.state()["state"] == h.state()["state"] == "serving"
    head_lost_s = h.cluster.supervisor.head_lost_s
    with Tricklers(w.node.address, w.node.agent_port, SLOW // 2) as on_worker, \
            Tricklers(h.node.address, h.node.agent_port, SLOW // 2) as on_head:
        end = time.monotonic() + max(3 * head_lost_s, 12.0)  # past the old 10 s per read too
        while time.monotonic() < end:
            on_worker.step()
            on_head.step()
            time.sleep(0.3)
        assert h.proc.poll() is None and w.proc.poll() is None, (h.proc.poll(), w.proc.poll())
        assert w.state()["state"] == h.state()["state"] == "serving"
