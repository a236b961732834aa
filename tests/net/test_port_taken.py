"""A port another process holds (issue 33, item 4): dspark's HTTP servers (the agent, the
dashboard) report the bind's own error, not an AttributeError from tearing down a server that
never started, and the reader thread they start is stopped."""

from __future__ import annotations

import socket
import threading
from http.server import BaseHTTPRequestHandler

import pytest

from dspark.net.server import BoundedHTTPServer


@pytest.fixture
def taken():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    try:
        yield s.getsockname()[1]
    finally:
        s.close()


def test_a_taken_port_raises_the_bind_error_and_leaves_no_thread(taken):
    before = {t.ident for t in threading.enumerate()}
    with pytest.raises(OSError) as e:
        BoundedHTTPServer(("127.0.0.1", taken), BaseHTTPRequestHandler)
    assert e.value.errno == 98  # EADDRINUSE, the bind's own error
    left = [t for t in threading.enumerate() if t.ident not in before and t.name == "http-heads"]
    for t in left:
        t.join(timeout=5)
    assert not [t for t in left if t.is_alive()]


def test_the_dashboard_says_the_port_is_in_use(taken, tmp_path):
    from tests.harness.pair import run_dspark
    from tests.harness.standin import write_cluster

    r = run_dspark("dashboard", "--host", "127.0.0.1", "--port", str(taken), "--config",
                   str(write_cluster(tmp_path)), "--node", "h", timeout=60)
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert f"cannot bind 127.0.0.1:{taken}: Address already in use" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
