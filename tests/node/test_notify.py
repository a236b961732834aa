"""sd_notify's wire format, read back from a real datagram socket."""

import os
import socket

import pytest

from dspark.node.notify import Notifier, child_env


@pytest.fixture
def sock(tmp_path):
    path = str(tmp_path / "notify.sock")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(path)
    s.settimeout(2)
    yield s, path
    s.close()


def recv(s) -> str:
    return s.recv(4096).decode()


def test_messages_on_the_wire(sock):
    s, path = sock
    n = Notifier(env={"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "20000000", "WATCHDOG_PID": str(os.getpid())})
    assert n.enabled and n.watchdog_interval == 10.0
    assert n.status("loading: the model")
    assert recv(s) == "STATUS=loading: the model"
    n.extend_timeout(90)
    assert recv(s) == "EXTEND_TIMEOUT_USEC=90000000"
    assert n.ready("serving")
    assert recv(s) == "READY=1\nSTATUS=serving"
    assert not n.ready("again")  # READY=1 is sent once
    n.watchdog()
    assert recv(s) == "WATCHDOG=1"
    n.stopping("stopping (SIGTERM)")
    assert recv(s) == "STOPPING=1\nSTATUS=stopping (SIGTERM)"
    n.status("two\nlines")
    assert recv(s) == "STATUS=two lines"
    n.close()
    assert not n.status("closed")


def test_abstract_namespace_socket():
    name = f"@dspark-test-{os.getpid()}"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind("\0" + name[1:])
    s.settimeout(2)
    n = Notifier(env={"NOTIFY_SOCKET": name})
    try:
        assert n.status("x")
        assert recv(s) == "STATUS=x"
    finally:
        n.close()
        s.close()


def test_noop_outside_systemd():
    n = Notifier(env={})
    assert not n.enabled and not n.status("x") and n.watchdog_interval is None


def test_watchdog_meant_for_another_pid_is_ignored():
    n = Notifier(env={"WATCHDOG_USEC": "1000000", "WATCHDOG_PID": "1"})
    assert n.watchdog_interval is None


def test_child_env_drops_the_protocol_variables():
    env = {"NOTIFY_SOCKET": "/run/x", "WATCHDOG_USEC": "1", "WATCHDOG_PID": "2", "PATH": "/bin"}
    assert child_env(env) == {"PATH": "/bin"}
