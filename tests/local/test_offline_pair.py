"""The serving path makes no download attempt: the real local pair (vLLM CPU
build, `dspark local up`) started in a network namespace of this test's own that has only a
loopback interface, every process of it traced for connect(2) (strace -f), and every Python
process of it logging socket.getaddrinfo / socket.connect through an audit hook (a
sitecustomize on PYTHONPATH). It serves a request; no process of it may try to reach, or look
up, anything but loopback.

What this does not exercise: the GB10 kernels. FlashInfer, b12x, the CUTLASS DSL, Triton and
DeepGEMM do not run on the CPU build, so FlashInfer's cubin fetch on first use of a kernel (see
the README, "What the runtime fetches at run time") is outside this test."""

from __future__ import annotations

import ipaddress
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.harness.pair import (
    ARTIFACTS,
    ROOT,
    count_head_starts,
    kill_leftovers,
    local_head_log,
    pick_ports,
    record_start_ups,
)

pytestmark = pytest.mark.pair

HOOK = r'''
import json, os, sys
_dir = os.environ.get("DSPARK_NETLOG_DIR")
if _dir:
    _events = ("socket.connect", "socket.getaddrinfo", "socket.gethostbyname", "socket.gethostbyaddr",
               "socket.getnameinfo")

    def _dspark_netlog_write(rec):
        with open(os.path.join(_dir, "%d.jsonl" % os.getpid()), "a") as f:
            f.write(json.dumps(rec) + "\n")

    def _dspark_netlog(event, args):
        if event not in _events:
            return
        try:
            target = args[1] if event == "socket.connect" else args[0] if event != "socket.getaddrinfo" else args[:2]
            _dspark_netlog_write({"event": event, "target": repr(target)})
        except Exception:
            pass

    _dspark_netlog_write({"event": "start", "target": repr(sys.argv[:4])})
    sys.addaudithook(_dspark_netlog)
'''

DNS_LISTENER = r"""
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind(("127.0.0.1", 53))
with open(sys.argv[1], "a") as log:
    while True:  # ends when the test kills it
        data, peer = s.recvfrom(4096)
        q, i, labels = data[12:], 0, []
        while i < len(q) and q[i]:
            labels.append(q[i + 1:i + 1 + q[i]].decode(errors="replace"))
            i += 1 + q[i]
        log.write(".".join(labels) + "/" + str(int.from_bytes(q[i + 1:i + 3], "big")) + "\n")
        log.flush()
        # NXDOMAIN: the header with QR and RCODE 3, the question echoed, no answer.
        s.sendto(data[:2] + bytes([0x81 | (data[2] & 0x01), 0x83]) + data[4:6] + b"\0\0\0\0\0\0"
                 + data[12:12 + i + 5], peer)
"""

CONNECT = re.compile(r"connect\(\d+, \{sa_family=(AF_\w+)(.*?)\}, \d+")
EXECVE = re.compile(r'^(\d+)\s+execve\("([^"]+)", \[(.*?)\]')


def programs(trace: str) -> dict[str, str]:
    """pid -> the command line it last exec'd (strace's execve lines)."""
    out = {}
    for line in trace.splitlines():
        if m := EXECVE.match(line):
            out[m.group(1)] = m.group(3)[:160]
    return out


def remote_connects(trace: str) -> tuple[list[str], int]:
    """connect(2) calls to anything but loopback (strace lines, each with the program that made
    it), and how many went to loopback."""
    remote, local = [], 0
    progs = programs(trace)
    for line in trace.splitlines():
        m = CONNECT.search(line)
        if not m:
            continue
        family, rest = m.groups()
        if family in ("AF_UNIX", "AF_NETLINK", "AF_UNSPEC"):
            continue
        addr = re.search(r'inet_addr\("([^"]+)"\)|inet_pton\(AF_INET6, "([^"]+)"', rest)
        ip = ipaddress.ip_address(next(a for a in addr.groups() if a)) if addr else None
        if ip is not None and (ip.is_loopback or ip.is_unspecified
                               or (ip.version == 6 and ip.ipv4_mapped and ip.ipv4_mapped.is_loopback)):
            local += 1
        else:
            remote.append(f"{line.strip()}  [{progs.get(line.split()[0], '?')}]")
    return remote, local


def non_local_lookups(netlog: Path) -> tuple[list[dict], list[str]]:
    """Name lookups (getaddrinfo, gethostbyname) of a name that is not loopback or an address
    literal, and the command line of each Python process the audit hook ran in."""
    bad, started = [], []
    for f in sorted(netlog.glob("*.jsonl")):
        for line in f.read_text().splitlines():
            rec = json.loads(line)
            if rec["event"] == "start":
                started.append(rec["target"])
            if rec["event"] not in ("socket.getaddrinfo", "socket.gethostbyname"):
                continue
            target = eval(rec["target"])  # noqa: S307 - our own repr() of a host or (host, port)
            host = target[0] if isinstance(target, (list, tuple)) else target
            host = host.decode() if isinstance(host, bytes) else host
            if host in (None, "", "localhost", "localhost.localdomain"):
                continue
            try:
                ip = ipaddress.ip_address(host)
                if ip.is_loopback or ip.is_unspecified:
                    continue
            except ValueError:
                pass
            bad.append(dict(rec, pid=f.stem))
    return bad, started


def children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


def test_the_pair_serves_in_an_offline_namespace_without_trying_the_network(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("creating a network namespace needs root")
    for tool in ("ip", "strace"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} not installed (.ci/setup --system installs it)")
    ns = f"dspark-offline-{os.getpid()}"
    if subprocess.run(["ip", "netns", "add", ns], capture_output=True, timeout=30).returncode != 0:
        pytest.skip("ip netns add is not allowed here")
    workdir = tmp_path / "pair"
    workdir.mkdir()
    # The namespace's resolver: `ip netns exec` reads /etc/netns/NS/resolv.conf. A listener of
    # this test's own on the namespace's 127.0.0.1:53 logs every query and answers NXDOMAIN.
    etc = Path("/etc/netns") / ns
    queries = tmp_path / "dns-queries"
    proc = dns = None
    try:
        etc.mkdir(parents=True)
        (etc / "resolv.conf").write_text("nameserver 127.0.0.1\n")
        subprocess.run(["ip", "-n", ns, "link", "set", "lo", "up"], check=True, timeout=30)
        (tmp_path / "dns.py").write_text(DNS_LISTENER)
        dns = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, str(tmp_path / "dns.py"), str(queries)])
        links = subprocess.run(["ip", "-n", ns, "-o", "link"], capture_output=True, text=True, timeout=30).stdout
        assert [ln.split(":")[1].strip() for ln in links.splitlines()] == ["lo"]
        hook = tmp_path / "hook"
        hook.mkdir()
        (hook / "sitecustomize.py").write_text(HOOK)
        netlog = tmp_path / "netlog"
        netlog.mkdir()
        trace = tmp_path / "connect.trace"
        env = dict(os.environ, PYTHONPATH=str(hook), DSPARK_NETLOG_DIR=str(netlog))
        ports = pick_ports(2)
        out = workdir / "local-up.out"
        with open(out, "wb") as f:
            proc = subprocess.Popen(
                ["ip", "netns", "exec", ns, "strace", "-f", "-qq", "--seccomp-bpf", "-e", "trace=connect,execve",
                 "-e", "signal=none", "-s", "64",
                 "-o", str(trace), sys.executable, "-m", "dspark", "local", "up", "--dir", str(workdir),
                 "--api-port", str(ports.api), "--agent-port", str(ports.agent),
                 "--master-port", str(ports.master)],
                stdout=f, stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT, env=env)
        deadline = time.monotonic() + 900
        while "Ctrl-C stops " not in out.read_text(errors="replace"):
            assert proc.poll() is None, out.read_text(errors="replace")[-3000:]
            assert time.monotonic() < deadline, "not serving after 900 s:\n" + out.read_text(errors="replace")[-3000:]
            time.sleep(1)
        # One completion, asked from inside the namespace (the API listens there only).
        ask = ("import json, sys, urllib.request; "
               "body = json.dumps({'model': 'dspark-local', 'prompt': [1, 2, 3, 4], 'max_tokens': 4}).encode(); "
               "r = urllib.request.urlopen(urllib.request.Request(sys.argv[1], data=body, "
               "headers={'Content-Type': 'application/json'}), timeout=120); "
               "print(json.loads(r.read())['usage']['completion_tokens'])")
        got = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", ask,
                              f"http://127.0.0.1:{ports.api}/v1/completions"],
                             capture_output=True, text=True, timeout=180)
        assert got.returncode == 0 and got.stdout.strip() == "4", got.stderr[-2000:]
        # Stop as Ctrl-C does: SIGTERM to `local up` (strace's child), which stops both nodes.
        up = children(proc.pid)
        assert len(up) == 1, up
        os.kill(up[0], signal.SIGTERM)
        proc.wait(timeout=180)
        proc = None
    finally:
        if proc is not None and proc.poll() is None:
            for pid in children(proc.pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            proc.kill()
            proc.wait(timeout=30)
        kill_leftovers(workdir)
        record_start_ups("local pair in an offline namespace", count_head_starts(local_head_log(workdir)))
        if dns is not None:
            dns.kill()
            dns.wait(timeout=30)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        shutil.rmtree(etc, ignore_errors=True)
    text = trace.read_text(errors="replace")
    remote, local = remote_connects(text)
    lookups, started = non_local_lookups(netlog)
    if remote or lookups:  # keep the evidence: the trace and every process's audit log
        keep = ARTIFACTS / "offline-pair"
        shutil.rmtree(keep, ignore_errors=True)
        keep.mkdir(parents=True)
        shutil.copy(trace, keep / "connect.trace")
        shutil.copytree(netlog, keep / "netlog")
    # The tracing reached the pair: its processes connect to each other over loopback, and the
    # audit hook ran in both supervisors and in vLLM.
    assert local > 10, text[-2000:]
    assert sum("'serve'" in s for s in started) >= 2 and any("vllm" in s for s in started), started
    assert remote == [], "\n".join(remote[:20])
    assert lookups == [], json.dumps(lookups[:20], indent=1)
    # What reached the resolver: only reverse lookups of loopback addresses (torch's c10d looks
    # up the name of each TCPStore peer), never a name to fetch anything from.
    asked = queries.read_text().split() if queries.exists() else []
    assert all(q.endswith(".127.in-addr.arpa/12")
               or q.startswith("1.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.ip6")
               for q in asked), asked


def test_the_http_servers_bind_without_a_reverse_lookup_of_their_address():
    """http.server's server_bind calls socket.getfqdn(host), a reverse DNS lookup of the
    listening address; BoundedHTTPServer (the agent's and the dashboard's) skips it, so an agent
    on 127.0.0.2 or on a node's fabric address asks no resolver anything before it serves."""
    code = r"""
import socket, sys
seen = []
sys.addaudithook(lambda event, args: seen.append((event, args[0])) if event in (
    "socket.gethostbyaddr", "socket.gethostbyname", "socket.getaddrinfo", "socket.getnameinfo") else None)
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from dspark.net.server import BoundedHTTPServer
plain = ThreadingHTTPServer(("127.0.0.2", 0), BaseHTTPRequestHandler)
plain.server_close()
print(seen[-1] if seen else None)
seen.clear()
ours = BoundedHTTPServer(("127.0.0.2", 0), BaseHTTPRequestHandler)
print(ours.server_name, ours.server_address[0])
ours.server_close()
print(seen)
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    plain, names, ours = proc.stdout.splitlines()
    assert plain == "('socket.gethostbyaddr', '127.0.0.2')"  # what http.server itself does
    assert names == "127.0.0.2 127.0.0.2"
    assert ours == "[]"


# VllmProcess's log pipe and Popen live as long as the supervisor, which never closes them
# itself; a test that drops the object earlier sees them as unraisable ResourceWarnings.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_vllm_is_started_with_usage_statistics_off(tmp_path):
    """vLLM's GPU worker (rank 0) posts usage statistics to its maintainers' server at start and
    every 10 minutes unless VLLM_NO_USAGE_STATS, DO_NOT_TRACK or ~/.config/vllm/do_not_track
    says not to; the CPU worker never does, so the pair above cannot show it. Here vLLM's own
    is_usage_stats_enabled(), run in the environment dspark's VllmProcess gives vLLM."""
    from dspark.node.launch import Launch
    from dspark.node.vllm_process import VllmProcess

    code = "from vllm.usage.usage_lib import is_usage_stats_enabled; print('enabled', is_usage_stats_enabled())"
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_NO_USAGE_STATS", "DO_NOT_TRACK", "VLLM_DO_NOT_TRACK")}
    env["HOME"] = str(tmp_path)  # no do_not_track file of this machine's user
    plain = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert plain.stdout.strip().splitlines()[-1] == "enabled True", plain.stderr[-2000:]
    out = tmp_path / "out"
    with open(out, "w") as f:
        proc = VllmProcess(Launch([sys.executable, "-c", code], {}), env, out=f)
        proc.start()
        assert proc.proc.wait(timeout=300) == 0
        deadline = time.monotonic() + 30  # the log pump thread copies the last line
        while "enabled" not in out.read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.2)
        proc.proc.stdout.close()
    assert out.read_text().strip().splitlines()[-1] == "enabled False"
