"""Every HTTP client of dspark against a decompression bomb and a peer that sends its answer's
head a byte at a time (issue 33, items 5 and 6).

Each caller runs in a process of its own, as it does in use: `dspark status`, `dspark bench
prefill`, the bench's streamed completion, the dashboard's collector, the head's poll of its
peers' agents (dspark.node.probes.poll_agents, what its supervisor runs each round of the
rendezvous) and the head's real supervisor (`dspark serve`) waiting for a hostile worker. The
process's wall time and peak RSS (its VmHWM) are measured: the bomb is refused without being
inflated, the trickle ends at the caller's deadline.

Before the fix: the bomb took each caller to 2.0-2.5 GB of RSS (1 GiB inflated before any cap
was checked; the dashboard's child hit this test's 3 GiB address-space cap) and the trickle
held every caller until the server gave up (30 s here; `status` and the collector past 60 s)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import pytest

from dspark.config import validate as C
from dspark.config.template import dumps
from dspark.node.policy import EXIT_NEVER_READY
from tests.harness.hostile import HostileServer
from tests.harness.hostile_http import gzip_gzip_bomb, gzip_of_zeros, hostile, inflate
from tests.harness.standin import write_cluster

BOMB_MIB = 1024           # what the bomb inflates to: 1 GiB of zeros
RSS_LIMIT_MB = 300        # a caller's peak RSS: ~60 MB measured after the fix, the bomb alone is 1,024 MB
AS_LIMIT = 3 << 30        # a child's address space: a regression fails the test, not the host
SLACK_S = 12.0            # start-up and imports on a loaded 2-core host (~0.5 s measured idle)
PATHS = ("/state", "/health", "/version", "/metrics", "/v1/models", "/v1/completions")
ATTACKS = ("bomb", "trickle")
REFUSED = {"bomb": "Content-Encoding", "trickle": "deadline"}  # what each caller's message says


@pytest.fixture(scope="module")
def bomb() -> bytes:
    body = gzip_gzip_bomb(BOMB_MIB)
    assert len(body) < 4096
    return body


def test_the_bomb_is_what_it_says(bomb):
    """Its outer layer inflates to a gzip of BOMB_MIB MiB (the length its trailer states; fully
    inflated, that takes ~8 s), built as gzip_of_zeros builds 16 MiB, checked in full here."""
    assert inflate(gzip_of_zeros(16)) == (16 << 20, True)
    inner = zlib.decompressobj(31).decompress(bomb)
    assert inner == gzip_of_zeros(BOMB_MIB) and int.from_bytes(inner[-4:], "little") == (BOMB_MIB << 20) % 2**32


@dataclass
class Ran:
    rc: int
    out: str
    err: str
    wall_s: float
    rss_mb: float


def _hwm_mb(pid: int) -> float:
    """The process's own peak RSS (VmHWM, of its address space since its exec), MB; 0 once gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0.0


def reap(p: subprocess.Popen, t0: float, limit_s: float) -> tuple[float, float]:
    """Wait for `p` (killed past `limit_s` from `t0`); its wall time and own peak RSS (MB), read
    from its VmHWM every 20 ms while it runs. Not wait4's ru_maxrss: a child forked from this
    pytest worker starts with the worker's RSS as its maximum (Linux keeps it across exec), and an
    xdist worker that imported vLLM for an earlier test is 500 MB before the child does anything."""
    peak = 0.0
    while True:
        peak = max(peak, _hwm_mb(p.pid))
        pid, status = os.waitpid(p.pid, os.WNOHANG)
        if pid:
            break
        if time.monotonic() - t0 > limit_s:
            p.kill()
            pid, status = os.waitpid(p.pid, 0)
            break
        time.sleep(0.02)
    p.returncode = os.waitstatus_to_exitcode(status)
    return time.monotonic() - t0, peak


PREAMBLE = f"import resource, sys; resource.setrlimit(resource.RLIMIT_AS, ({AS_LIMIT}, {AS_LIMIT}))\n"


def run_child(code: str, tmp: Path, limit_s: float = 60) -> Ran:
    """`code` in a fresh interpreter, its address space capped at AS_LIMIT."""
    out_p, err_p = tmp / "child.out", tmp / "child.err"
    with open(out_p, "wb") as out, open(err_p, "wb") as err:
        t0 = time.monotonic()
        p = subprocess.Popen([sys.executable, "-c", PREAMBLE + code], stdout=out, stderr=err,
                             stdin=subprocess.DEVNULL)
        wall, rss = reap(p, t0, limit_s)
    return Ran(p.returncode, out_p.read_text(), err_p.read_text(), wall, rss)


def cli(*args: str) -> str:
    return f"import runpy; sys.argv = {['dspark', *args]!r}; runpy.run_module('dspark', run_name='__main__')"


def check(ran: Ran, attack: str, budget_s: float, what: str, says_why: bool = True) -> None:
    """No traceback, a small peak RSS, done within `budget_s` (+ SLACK_S), saying why it failed."""
    figures = f"{what} / {attack}: {ran.wall_s:.1f} s, peak RSS {ran.rss_mb:.0f} MB, rc {ran.rc}"
    print(figures)
    assert "Traceback" not in ran.out + ran.err and "MemoryError" not in ran.out + ran.err, \
        f"{figures}\n{ran.out[-3000:]}\n{ran.err[-3000:]}"
    assert ran.rss_mb < RSS_LIMIT_MB, figures
    assert ran.wall_s < budget_s + SLACK_S, figures
    if says_why:
        assert REFUSED[attack] in ran.out + ran.err, f"{figures}\n{ran.out[-2000:]}\n{ran.err[-2000:]}"


def port(server: HostileServer) -> int:
    return int(server.url.rsplit(":", 1)[1])


@pytest.mark.parametrize("attack", ATTACKS)
def test_status(tmp_path, bomb, attack):
    """Both agents and the API hostile: three requests of 2 s each at most (the version is not
    asked for when /health has no answer); each node's detail says why it is unreachable."""
    with hostile(attack, bomb, PATHS, hosts=("127.0.0.1", "127.0.0.2", "127.0.0.1")) as (head, worker, api):
        data = {"model": {"path": str(tmp_path), "served_name": "m"},
                "serving": {"tensor_parallel_size": 2, "speculative_config": {}},
                "nodes": [{"name": "h", "rank": 0, "address": "127.0.0.1", "api_host": "127.0.0.1",
                           "api_port": port(api), "agent_port": port(head)},
                          {"name": "w", "rank": 1, "address": "127.0.0.2", "agent_port": port(worker)}]}
        path = tmp_path / "cluster.toml"
        path.write_text(dumps(data))
        ran = run_child(cli("status", "--config", str(path), "--json"), tmp_path)
    check(ran, attack, 3 * 2.0, "dspark status")
    assert ran.rc == 1
    snap = json.loads(ran.out)
    assert [n["state"] for n in snap["nodes"]] == ["unreachable", "unreachable"]
    assert all(REFUSED[attack] in n["detail"] for n in snap["nodes"]), snap["nodes"]
    assert snap["api"]["health"] is None


@pytest.mark.parametrize("attack", ATTACKS)
def test_bench_prefill(tmp_path, bomb, attack):
    """`--request-timeout` bounds every request of the run, the server's description included."""
    with hostile(attack, bomb, PATHS) as (api,):
        ran = run_child(cli("bench", "prefill", "--url", api.url, "--request-timeout", "2", "--lengths", "16",
                            "--trials", "1", "--out", str(tmp_path / "out"), "--quiet"), tmp_path)
    check(ran, attack, 2.0, "dspark bench prefill")
    assert ran.rc == 1 and "bench prefill: server unreachable or failing" in ran.err, ran.err


@pytest.mark.parametrize("attack", ATTACKS)
def test_bench_streamed_completion(tmp_path, bomb, attack):
    with hostile(attack, bomb, PATHS) as (api,):
        code = ("from dspark.bench.client import BenchError, Target, stream_completion\n"
                "try:\n"
                f"    stream_completion(Target({api.url!r}, timeout_s=2.0), 'm', [1, 2, 3], 4)\n"
                "except BenchError as e:\n"
                "    print('BenchError:', e)\n")
        ran = run_child(code, tmp_path)
    check(ran, attack, 2.0, "bench stream_completion")
    assert ran.rc == 0 and ran.out.startswith("BenchError: server unreachable or failing"), ran.out


@pytest.mark.parametrize("attack", ATTACKS)
def test_dashboard_collector(tmp_path, bomb, attack):
    """One round of the collector: /metrics and both agents at once (2 s), then /version (2 s)."""
    with hostile(attack, bomb, PATHS, hosts=("127.0.0.1", "127.0.0.2")) as (head, worker):
        code = ("import json\n"
                "from dspark.dashboard.collector import Collector, NodeTarget, Targets\n"
                f"t = Targets(api_url={head.url!r}, nodes=(NodeTarget('h', 0, 'head', {head.url!r}),\n"
                f"            NodeTarget('w', 1, 'worker', {worker.url!r})))\n"
                "c = Collector(t, timeout_s=2.0)\n"
                "try:\n"
                "    print(json.dumps(c.tick()))\n"
                "finally:\n"
                "    c.stop()\n")
        ran = run_child(code, tmp_path)
    check(ran, attack, 2 * 2.0, "dashboard collector")
    assert ran.rc == 0, ran.err


@pytest.mark.parametrize("attack", ATTACKS)
def test_head_polling_its_peer(tmp_path, bomb, attack):
    """What the head's supervisor runs each round of the rendezvous (poll_agents, 1 s)."""
    with hostile(attack, bomb, PATHS, hosts=("127.0.0.2",)) as (worker,):
        code = ("from dspark.node.probes import poll_agents\n"
                f"a = poll_agents({{'w': {worker.url!r}}}, timeout=1.0)['w']\n"
                "print(a.state, a.refused, a.error)\n")
        ran = run_child(code, tmp_path)
    check(ran, attack, 1.0, "head polling its peer")
    assert ran.rc == 0 and ran.out.startswith("None False "), ran.out


@pytest.mark.parametrize("attack", ATTACKS)
def test_head_supervisor_gives_up_on_a_hostile_worker_in_time(tmp_path, serve, bomb, attack):
    """The head's real supervisor (`dspark serve`), its worker's agent hostile: it gives up at
    worker_wait_timeout_s (3 s here) with the usual message, its RSS small."""
    cluster = write_cluster(tmp_path, nodes=2, worker_wait_timeout_s=3.0)
    w = C.load(cluster).node("w")
    with hostile(attack, bomb, PATHS, hosts=(w.address,), ports=(w.agent_port,)):
        head = serve(cluster, "h")
        wall, rss = reap(head.proc, head.t0, limit_s=60)
        out = head.proc.stdout.read() if head.proc.stdout else ""
    ran = Ran(head.proc.returncode, out, "", wall, rss)
    check(ran, attack, 3.0 + 1.0, "head supervisor in the rendezvous", says_why=False)  # it logs states
    assert ran.rc == EXIT_NEVER_READY, out[-3000:]
    assert "worker not ready after 3 s: w at " in out and "is unreachable" in out, out[-3000:]
