"""Helpers shared by the tests and benchmarks: run dspark, free loopback ports, and the
real local pair started through `dspark local up` (the README's main job)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dspark.local.cluster import LocalPorts

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "test-artifacts"
# Where every real vLLM start-up of a run is recorded, one JSON line each (.ci/run sets it and
# prints the total): `record_start_ups` is called by what starts real vLLM pairs and rings.
START_UPS_ENV = "DSPARK_TEST_START_UPS"
HEAD_STARTS_VLLM = "starting vLLM: "  # the head supervisor's line for each vLLM it starts


def count_head_starts(head_log: str) -> int:
    """How many times a head's supervisor started vLLM, read off its own log (or journal): the
    first start, each restart, each switch and each rollback all say it."""
    return sum(1 for line in head_log.splitlines() if HEAD_STARTS_VLLM in line)


def local_head_log(workdir: Path) -> str:
    """The head supervisor's log of a `local up --dir workdir` (empty before it has one)."""
    from dspark.local.cluster import node_name

    try:
        return (workdir / "logs" / f"{node_name(0)}.log").read_text(errors="replace")
    except OSError:
        return ""


def record_start_ups(what: str, head_starts: int, nodes: int = 2) -> int:
    """Record `head_starts` real start-ups of a `nodes`-node vLLM appliance (a ring of four counts
    as two pairs) in the file $DSPARK_TEST_START_UPS names (nothing when unset); the pairs counted."""
    pairs = head_starts * max(1, nodes // 2)
    target = os.environ.get(START_UPS_ENV)
    if target and pairs:
        with open(target, "a") as f:
            f.write(json.dumps({"what": what, "head_starts": head_starts, "nodes": nodes, "pairs": pairs}) + "\n")
    return pairs


def dspark_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "dspark", *args]


def run_dspark(*args: str, timeout: float = 60, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(dspark_cmd(*args), capture_output=True, text=True, timeout=timeout, **kw)


def process_group(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read(4096).rsplit(b")", 1)[1].split()[2])
    except (OSError, IndexError, ValueError):
        return None


def kill_leftovers(workdir: Path, groups: Iterable[int] = ()) -> None:
    """Leave nothing behind: SIGKILL every process (supervisor, vLLM) whose command line names
    `workdir`, a directory of the test's own, and every process of their process groups and of
    `groups` (groups the test's own processes lead). vLLM's engine and TP workers rename
    themselves (`VLLM::Worker_TP1`): their command line no longer names `workdir`, their
    process group is still their vLLM's, so a group is the way to find them."""
    from dspark.node.vllm_process import end_group

    leftover = subprocess.run(["pgrep", "-f", str(workdir)], capture_output=True, text=True).stdout.split()
    pgids = set(groups)
    for pid in leftover:
        g = process_group(int(pid)) if pid.isdigit() else None
        if g is not None and g != os.getpgrp():
            pgids.add(g)
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    for g in sorted(pgids):
        if g > 1 and g != os.getpgrp():
            end_group(g, gone_s=10)


def vllm_groups(pair: PairHandle) -> set[int]:
    """The process groups of the pair's vLLM runs now (each vLLM leads its own)."""
    out = set()
    for name in pair.names:
        try:
            pid = pair.state(name).get("vllm_pid")
        except (OSError, ValueError):
            continue
        if isinstance(pid, int) and pid > 1:
            out.add(pid)
    return out


def get_json(url: str, timeout: float = 2.0):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def pick_ports(nodes: int = 2) -> LocalPorts:
    from dspark.local.cluster import LocalError, LocalPorts
    from dspark.local.lock import check_ports_free

    rng = random.Random(os.getpid() ^ time.monotonic_ns())
    for _ in range(50):
        base = rng.randrange(21000, 29000, 10)
        ports = LocalPorts(api=base, master=base + 1, agent=base + 2)
        try:
            check_ports_free(ports, nodes)
            return ports
        except LocalError:
            continue
    raise RuntimeError("no free ports found for a local pair")


def node_counts_arg(text: str) -> list[int]:
    """A benchmark's `--nodes 2,4`: the node counts the local appliance runs (argparse type)."""
    import argparse

    from dspark.local.cluster import valid_node_counts

    try:
        counts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--nodes {text!r}: give node counts such as 2,4") from None
    if not counts or any(n not in valid_node_counts() for n in counts):
        raise argparse.ArgumentTypeError(f"--nodes {text!r}: the local appliance runs "
                                         f"{' or '.join(map(str, valid_node_counts()))} nodes")
    return counts


@dataclass
class PairHandle:
    """A running `dspark local up`: the very command the README gives."""

    proc: subprocess.Popen
    workdir: Path
    ports: LocalPorts
    output: Path
    nodes: int = 2
    groups: set = field(default_factory=set)  # vLLM process groups a test saw: swept at teardown
    recorded: bool = False  # its start-ups are recorded once, at its stop

    @property
    def names(self) -> list[str]:
        """Every node's name, by rank (the head's first)."""
        from dspark.local.cluster import node_name

        return [node_name(r) for r in range(self.nodes)]

    @property
    def cluster_file(self) -> Path:
        return self.workdir / "cluster.toml"

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.ports.api}"

    def agent_url(self, node: str) -> str:
        from dspark.local.cluster import node_address

        return f"http://{node_address(self.names.index(node))}:{self.ports.agent}"

    def state(self, node: str) -> dict:
        return get_json(self.agent_url(node) + "/state")

    def log(self) -> str:
        return self.output.read_text(errors="replace")

    def stop(self, timeout: float = 60) -> int:
        """Ctrl-C, as a user stops it (SIGKILL of its group after `timeout`); its real vLLM start-ups
        (every start the head's log records, switches and rollbacks included) are recorded once."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        if not self.recorded:
            self.recorded = True
            record_start_ups(f"local up, {self.nodes} nodes: {self.workdir.parent.name}/{self.workdir.name}",
                             count_head_starts(local_head_log(self.workdir)), self.nodes)
        return self.proc.returncode


def start_pair(workdir: Path, timeout: float = 600, nodes: int = 2, line: str | None = None,
               env: dict[str, str] | None = None, vision: bool = False) -> PairHandle:
    ports = pick_ports(nodes)
    workdir.mkdir(parents=True, exist_ok=True)
    output = workdir / "local-up.out"
    out = open(output, "wb")
    proc = subprocess.Popen(
        dspark_cmd("local", "up", "--dir", str(workdir), "--api-port", str(ports.api),
                   "--agent-port", str(ports.agent), "--master-port", str(ports.master), "--nodes", str(nodes),
                   *(("--line", line) if line is not None else ()), *(("--vision",) if vision else ())),
        stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT,
        env={**os.environ, **env} if env else None)
    out.close()
    pair = PairHandle(proc, workdir, ports, output, nodes)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"dspark local up exited with {proc.returncode}:\n{pair.log()}")
            if "Ctrl-C stops " in pair.log():
                return pair
            time.sleep(0.5)
        raise RuntimeError(f"local {nodes}-node appliance not serving after {timeout} s:\n{pair.log()}")
    except BaseException:  # a pair that did not come up leaves nothing behind either
        pair.stop()
        kill_leftovers(workdir)
        raise
