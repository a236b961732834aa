"""The agent's and the dashboard's HTTP servers against clients that misbehave: idle and half-open
connections, a flood of them, a refused request's body on a keep-alive connection, a token file its
group can read. Real servers on loopback."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from dspark.dashboard import collector as C
from dspark.dashboard import server as S
from dspark.node.agent import Agent

SNAP = {"node": "n", "rank": 0, "role": "head", "state": "serving", "restarts": 0, "uptime_s": 1.0,
        "vllm_pid": None, "vllm_version": None, "dspark_version": "0", "liveness": None}


@pytest.fixture(params=["agent", "dashboard"])
def server(request, monkeypatch):
    try:
        import dspark.net.server as H
    except ImportError:  # an old tree: no bounded server at all
        H = None
    if H is not None:
        monkeypatch.setattr(H, "SOCKET_TIMEOUT_S", 1.0)
    if request.param == "agent":
        srv = Agent("127.0.0.1", 0, lambda: SNAP).start()
        url_port = srv.port
    else:
        col = C.Collector(C.Targets("http://127.0.0.1:1", ()), timeout_s=0.2)
        srv = S.DashboardServer("127.0.0.1", 0, col).start()
        url_port = srv.port
    try:
        yield url_port
    finally:
        srv.stop()


def connect(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    return s


def read_all(s: socket.socket, limit_s: float = 5.0) -> bytes:
    s.settimeout(0.5)
    out, end = b"", time.monotonic() + limit_s
    while time.monotonic() < end:
        try:
            chunk = s.recv(65536)
        except TimeoutError:
            continue
        if not chunk:
            break
        out += chunk
    return out


def healthz(port: int) -> bytes:
    with connect(port) as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        return read_all(s)


def test_an_idle_connection_is_closed_after_the_socket_timeout(server):
    with connect(server) as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # never finishes its headers
        t0 = time.monotonic()
        s.settimeout(5)
        try:
            data = s.recv(100)
        except TimeoutError:
            data = None
        assert data is not None and time.monotonic() - t0 < 4  # closed by the server, not by us


def test_a_flood_of_idle_connections_holds_a_bounded_number_of_threads(server):
    MAX_CONNECTIONS = 32  # dspark.net.server.MAX_CONNECTIONS (the test must run before it existed too)

    before = threading.active_count()
    socks = [connect(server) for _ in range(3 * MAX_CONNECTIONS)]
    try:
        time.sleep(0.5)
        assert threading.active_count() - before <= MAX_CONNECTIONS + 1
    finally:
        for s in socks:
            s.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and b" 200 " not in healthz(server):
        time.sleep(0.2)
    assert b" 200 " in healthz(server)  # served again once the flood is gone


def test_a_refused_body_is_never_read_as_a_second_request(server):
    smuggled = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    with connect(server) as s:
        s.sendall(b"POST /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: %d\r\n\r\n" % len(smuggled)
                  + smuggled)
        s.shutdown(socket.SHUT_WR)
        answer = read_all(s)
    assert answer.count(b"HTTP/1.") == 1 and b" 405 " in answer, answer


def test_a_body_on_a_get_does_not_desynchronise_keep_alive(server):
    smuggled = b"POST /x HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    with connect(server) as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: %d\r\n\r\n" % len(smuggled)
                  + smuggled)
        s.shutdown(socket.SHUT_WR)
        answer = read_all(s)
    assert answer.count(b"HTTP/1.") == 1 and b" 200 " in answer, answer


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o660, 0o644])
def test_token_file_readable_by_its_group_is_refused(tmp_path, mode):
    f = tmp_path / "token"
    f.write_text("t0ken\n")
    f.chmod(mode)
    with pytest.raises(S.DashboardError, match="chmod 600"):
        S.load_token(f)
    f.chmod(0o400)
    assert S.load_token(f) == "t0ken"
