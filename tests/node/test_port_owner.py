"""The supervisor's probes go only to dspark's own vLLM (issue 33, item 3).

A process that listens on the API port before vLLM binds it received the supervisor's probes,
each with `Authorization: Bearer <key>`, and the head reported serving. dspark.node.port_owner reads
who listens on a port from /proc; VllmProbes, given the process group of the vLLM the supervisor
started, sends nothing while the listener is another process's and says who holds the port.
The listeners here are real processes on loopback: a recording HTTP server started in a process
group of its own (standing for vLLM) or in this test's group (standing for someone else)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dspark.node.port_owner import foreign_listener, listening_inodes
from dspark.node.probes import VllmProbes

# A one-file HTTP server that answers 200 to anything and appends each request's path and
# Authorization header to a file: what a port squatter would collect.
RECORDER = r"""
import json, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
log = open(sys.argv[2], "a")
class H(BaseHTTPRequestHandler):
    def _answer(self):
        n = int(self.headers.get("Content-Length") or 0)
        if n:
            self.rfile.read(n)
        log.write(json.dumps([self.path, self.headers.get("Authorization")]) + "\n"); log.flush()
        body = b'{"choices": [{"text": "x"}], "version": "0.28.0"}'
        self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
        self.wfile.write(body)
    do_GET = do_POST = _answer
    def log_message(self, *a):
        pass
s = HTTPServer(("127.0.0.1", int(sys.argv[1])), H)
print("listening", flush=True)
s.serve_forever()
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def recorder(tmp_path):
    """start(own_group) -> (process, port, log path); every process is ended by its PID."""
    procs: list[subprocess.Popen] = []

    def start(own_group: bool, port: int | None = None):
        port, log = port or free_port(), tmp_path / f"requests-{len(procs)}.jsonl"
        p = subprocess.Popen([sys.executable, "-c", RECORDER, str(port), str(log)], stdout=subprocess.PIPE,
                             text=True, process_group=0 if own_group else None)
        procs.append(p)
        assert p.stdout is not None and p.stdout.readline().strip() == "listening"
        return p, port, log

    yield start
    for p in procs:
        p.kill()
        p.wait(timeout=10)
        if p.stdout is not None:
            p.stdout.close()


@pytest.fixture
def other_group():
    """A process group leader that holds no port (the vLLM that lost the race for it)."""
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], process_group=0)
    yield p.pid
    os.kill(p.pid, signal.SIGKILL)
    p.wait(timeout=10)


def requests_seen(log: Path) -> list:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def test_nothing_listening_is_not_foreign(other_group):
    port = free_port()
    assert listening_inodes(port) == set()
    assert foreign_listener(port, other_group) is None


def test_our_groups_listener_is_ours(recorder):
    p, port, _ = recorder(own_group=True)
    assert listening_inodes(port)
    assert foreign_listener(port, p.pid) is None


def test_someone_elses_listener_is_named(recorder, other_group):
    p, port, _ = recorder(own_group=False)
    said = foreign_listener(port, other_group)
    assert said is not None and f"port {port} is held by PID {p.pid} (user " in said, said
    assert "not by dspark's vLLM" in said


def test_no_probe_and_no_key_reach_a_squatter(recorder, other_group):
    squatter, port, log = recorder(own_group=False)
    probes = VllmProbes(f"http://127.0.0.1:{port}", "m", api_key="sk-secret", group=lambda: other_group)
    assert probes.health() is False
    live = probes.one_token(timeout=2)
    assert not live.ok and f"held by PID {squatter.pid}" in (live.error or "")
    assert probes.progress(timeout=2) is None and probes.version() is None
    time.sleep(0.2)
    assert requests_seen(log) == []  # nothing sent, so no key either
    # Without the owner check (what the supervisor did), the squatter collects the key.
    blind = VllmProbes(f"http://127.0.0.1:{port}", "m", api_key="sk-secret")
    assert blind.health() is True
    assert requests_seen(log) == [["/health", "Bearer sk-secret"]]


def test_the_probes_reach_our_own_vllm(recorder):
    ours, port, log = recorder(own_group=True)
    probes = VllmProbes(f"http://127.0.0.1:{port}", "m", api_key="sk-secret", group=lambda: ours.pid)
    assert probes.health() is True and probes.one_token(timeout=5).ok
    assert [path for path, _ in requests_seen(log)] == ["/health", "/v1/completions"]
    # Before vLLM is started there is no group: nothing is sent.
    assert VllmProbes(f"http://127.0.0.1:{port}", "m", group=lambda: None).health() is False


def test_a_head_whose_api_port_is_taken_sends_it_nothing(tmp_path, recorder, serve):
    """The supervisor's own probes (the stand-in vLLM loads for 3 s, then finds the port taken
    and exits): the squatter gets no request, so no key, and the head never reports serving."""
    from dspark.config import validate as C
    from tests.harness.standin import write_cluster

    cluster = write_cluster(tmp_path)
    port = C.load(cluster).node("h").api_port
    _, _, log = recorder(own_group=False, port=port)
    s = serve(cluster, "h", STANDIN_READY_DELAY="3", DSPARK_API_KEY="sk-secret")
    rc = s.wait(timeout=120)
    assert rc != 0
    assert "READY=1" not in " ".join(s.messages)
    assert requests_seen(log) == []
