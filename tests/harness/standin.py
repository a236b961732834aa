"""`dspark serve` as a real process against the stand-in vLLM (tests/harness/standin_vllm.py): the cluster
file it reads, the process with its notify socket, and small process helpers. The `serve`
fixture (conftest.py) starts them and closes them after the test."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from dspark.config import validate as C
from dspark.config.template import dumps
from tests.harness.pair import dspark_cmd, get_json

STANDIN = Path(__file__).parent / "standin_vllm.py"


def free_port(host="127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def write_cluster(tmp: Path, nodes: int = 1, **supervisor) -> Path:
    (tmp / "model").mkdir(exist_ok=True)
    sup = {"liveness_interval_s": 0.5, "liveness_timeout_s": 1.0, "liveness_failures": 2, "stop_grace_s": 2.0,
           "ready_timeout_s": 30.0, "head_lost_s": 2.0, **supervisor}
    entries = [{"name": "h", "rank": 0, "address": "127.0.0.1", "api_host": "127.0.0.1",
                "api_port": free_port(), "agent_port": free_port(), "master_port": free_port()}]
    if nodes == 2:
        entries.append({"name": "w", "rank": 1, "address": "127.0.0.2", "agent_port": free_port("127.0.0.2")})
    data = {"model": {"path": str(tmp / "model"), "served_name": "m"},
            "serving": {"vllm_command": [sys.executable, str(STANDIN)], "tensor_parallel_size": nodes,
                        "speculative_config": {}, "env": {"FROM_CONFIG": "1"}},
            "supervisor": sup, "nodes": entries}
    path = tmp / "cluster.toml"
    path.write_text(dumps(data))
    return path


class Serve:
    """A `dspark serve` process with a real notify socket."""

    def __init__(self, tmp: Path, cluster: Path, node: str, *serve_args: str, **standin_env):
        self.sock_path = str(tmp / f"notify-{node}.sock")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.sock_path)
        self.sock.settimeout(0.2)
        self.messages: list[str] = []
        self.t0_file = tmp / f"standin-t0-{node}"
        env = {**os.environ, "NOTIFY_SOCKET": self.sock_path, "WATCHDOG_USEC": "4000000",
               "STANDIN_T0_FILE": str(self.t0_file), **{k: str(v) for k, v in standin_env.items()}}
        self.cluster = C.load(cluster)
        self.node = self.cluster.node(node)
        self.proc = subprocess.Popen(dspark_cmd("serve", "--config", str(cluster), "--node", node, "--skip-plan",
                                                "--state-dir", str(tmp / f"state-{node}"), *serve_args),
                                     env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.t0 = time.monotonic()

    def read(self, until: str | None = None, timeout: float = 30) -> list[str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                self.messages.append(self.sock.recv(4096).decode())
            except TimeoutError:
                if self.proc.poll() is not None and until is None:
                    break
                continue
            if until is not None and until in self.messages[-1]:
                return self.messages
        if until is not None:
            raise AssertionError(f"no {until!r} within {timeout} s; got {self.messages}")
        return self.messages

    def standin_t0(self) -> float:
        """The monotonic moment the stand-in's STANDIN_*_AFTER times count from (its latest
        start): on a loaded host it starts seconds after this process, so a bound measured
        from self.t0 would count those seconds against the supervisor."""
        return float(self.t0_file.read_text())

    def state(self) -> dict:
        return get_json(self.node.agent_url + "/state")

    def wait(self, timeout: float = 30) -> int:
        rc = self.proc.wait(timeout=timeout)
        self.read(timeout=0.3)
        return rc

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout:
            self.proc.stdout.close()
        self.sock.close()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is gone for our purposes
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except OSError:
        return False
