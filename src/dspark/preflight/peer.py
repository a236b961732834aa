"""This node's identity (what its agent serves in /state: the cluster file's hash, the vLLM
runtime's version and sources, the model directory's fingerprint), its ports, and the
comparison with a peer whose agent answers: same cluster file, runtime and model, clocks
within a second."""

from __future__ import annotations

import errno
import hashlib
import ipaddress
import os
import pwd
import shutil
import socket
import struct
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from dspark.config.schema import Cluster, NodeConfig
from dspark.files.safe_read import MAX_MODEL_CONFIG_BYTES, MAX_MODEL_INDEX_BYTES, read_bytes
from dspark.preflight.result import Check, fail, ok, warn

CLOCK_TOLERANCE_S = 1.0


# ------------------------------------------------------------------------------ identity
def cluster_sha256(path: str | None) -> str | None:
    """The cluster file's SHA-256, byte for byte (the same file on every node)."""
    if not path:
        return None
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return None


def _runtime_python(vllm_command: list[str]) -> str | None:
    """The Python interpreter behind vLLM's command: `python -m ...`, a script's shebang, or the
    `python` beside a wrapper (a venv's or the Nix runtime's bin/)."""
    first = shutil.which(vllm_command[0]) if vllm_command else None
    if first is None:
        return None
    if "python" in Path(first).name:
        return first
    try:
        with open(first, "rb") as f:
            line = f.readline(512)
    except OSError:
        return None
    if line.startswith(b"#!") and b"python" in line:
        words = line[2:].decode(errors="replace").split()
        if words and words[0].endswith("/env") and len(words) > 1:
            return shutil.which(words[1])
        return words[0] if words else None
    beside = Path(first).parent / "python"
    return str(beside) if beside.exists() else None


_FIND_VLLM = ("import importlib.util as u; s = u.find_spec('vllm'); "
              "print(list(s.submodule_search_locations)[0] if s and s.submodule_search_locations else '')")


def vllm_package(vllm_command: list[str], timeout_s: float = 30.0) -> tuple[str | None, Path | None, str]:
    """(the Python behind vLLM's command, its installed vllm package directory, why not found),
    found without importing vLLM."""
    python = _runtime_python(vllm_command)
    if python is None:
        return None, None, f"cannot tell which Python runs {vllm_command[:1]}"
    try:
        r = subprocess.run([python, "-c", _FIND_VLLM], capture_output=True, text=True, timeout=timeout_s,
                           stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as e:
        return python, None, f"{python}: {e}"
    where = r.stdout.strip()
    if r.returncode != 0 or not where:
        return python, None, f"no vllm package for {python}"
    return python, Path(where), ""


def runtime_identity(vllm_command: list[str], timeout_s: float = 30.0) -> dict:
    """vLLM's version and a SHA-256 of its Python sources as installed (an overlay or any local
    change to them alters it), found without importing vLLM."""
    from dspark.lines.overlay import OverlayError, installed_vllm_version

    _, pkg, error = vllm_package(vllm_command, timeout_s)
    if pkg is None:
        return {"error": error}
    try:
        version = installed_vllm_version(pkg.parent)
    except OverlayError as e:
        version, _ = None, e
    h = hashlib.sha256()
    count = 0
    for dirpath, dirnames, filenames in os.walk(pkg):
        dirnames.sort()
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            p = os.path.join(dirpath, name)
            try:
                with open(p, "rb") as f:
                    data = f.read()
            except OSError:
                continue
            rel = os.path.relpath(p, pkg).encode()
            h.update(len(rel).to_bytes(4, "little") + rel + len(data).to_bytes(8, "little") + data)
            count += 1
    return {"vllm_version": version, "vllm_sources_sha256": h.hexdigest(), "vllm_sources_files": count}


def model_fingerprint(model_path: str) -> str | None:
    """SHA-256 of config.json, the index, and every shard's name and size: two nodes with the
    same download agree; a missing, extra or truncated shard differs."""
    d = Path(model_path)
    h = hashlib.sha256()
    try:
        for name in ("config.json", "model.safetensors.index.json"):
            if (d / name).exists():
                limit = MAX_MODEL_CONFIG_BYTES if name == "config.json" else MAX_MODEL_INDEX_BYTES
                h.update(name.encode() + b"\0" + read_bytes(d / name, limit))
        for p in sorted(d.glob("*.safetensors")):
            h.update(f"{p.name}\0{p.stat().st_size}\n".encode())
    except OSError:
        return None
    return h.hexdigest()


def local_identity(cluster: Cluster) -> dict:
    return {"cluster_sha256": cluster_sha256(cluster.source), "model_sha256": model_fingerprint(cluster.model.path),
            "runtime_line": cluster.serving.runtime_line, **runtime_identity(cluster.serving.vllm_command)}


def check_runtime_line(cluster: Cluster, identity: dict) -> list[Check]:
    """The runtime that serving.vllm_command runs is the release of serving.runtime_line: the
    cluster file's settings are rendered to that line's flags and names, which another release
    may not have, or may mean otherwise."""
    from dspark.lines import runtime as runtime_lines

    line_id = cluster.serving.runtime_line
    line = runtime_lines.load().lines.get(line_id)
    found = identity.get("vllm_version")
    if line is None or not isinstance(found, str) or not found:
        return []  # an unknown line is refused with the cluster file; an unidentified runtime is warned of
    if found.split("+", 1)[0] != line.vllm:
        return [fail("runtime.line", f"serving.runtime_line is {line_id} (vLLM {line.vllm}), but "
                     f"serving.vllm_command ({cluster.serving.vllm_command[0]}) runs vLLM {found}",
                     f"point serving.vllm_command at line {line_id}'s runtime, or set serving.runtime_line "
                     "to the line of the runtime installed")]
    return [ok("runtime.line", f"runtime line {line_id}: vLLM {found}")]


# ------------------------------------------------------------------------------ ports
def _proc_net_address(hexaddr: str) -> str:
    """An address of /proc/net/tcp{,6}: 32-bit words in the host's byte order, in hex."""
    words = [int(hexaddr[i:i + 8], 16) for i in range(0, len(hexaddr), 8)]
    raw = b"".join(struct.pack("=I", w) for w in words)
    addr = ipaddress.ip_address(raw)
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped:
        addr = addr.ipv4_mapped
    return str(addr)


def _conflicts(listener: str, host: str) -> bool:
    wild = ("0.0.0.0", "::")
    if listener in wild or host in wild:
        return True
    try:
        return ipaddress.ip_address(listener) == ipaddress.ip_address(host)
    except ValueError:
        return False


@dataclass(frozen=True)
class Listener:
    """Who listens on a port: the socket's owner (uid) from /proc/net/tcp, which every user can
    read, and its process where /proc lets this user see its fds (root sees every process)."""

    uid: int | None
    pid: int | None = None
    cmdline: str = ""

    def describe(self) -> str:
        user = _user_name(self.uid) if self.uid is not None else "?"
        if self.pid is None:
            return f"a process of user {user} that this user cannot see"
        return f"pid {self.pid} (user {user}): {self.cmdline[:120]}"


def _user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def _listener_owner(host: str, port: int, proc: Path) -> Listener | None:
    """The process listening on TCP `port` where a bind of `host` collides, as far as /proc
    shows it; None when no listening socket is seen."""
    inodes: dict[str, int | None] = {}
    for table in ("tcp", "tcp6"):
        try:
            lines = (proc / "net" / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if len(f) <= 9 or f[3] != "0A":  # 0A: LISTEN
                continue
            addr, _, hexport = f[1].rpartition(":")
            try:
                if int(hexport, 16) == port and _conflicts(_proc_net_address(addr), host):
                    inodes[f[9]] = int(f[7]) if f[7].isdigit() else None
            except ValueError:
                continue
    if not inodes:
        return None
    for pid_dir in proc.glob("[0-9]*"):
        try:
            for fd in (pid_dir / "fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:[") and target[8:-1] in inodes:
                    return Listener(inodes[target[8:-1]], int(pid_dir.name), _cmdline(pid_dir))
        except OSError:
            continue
    return Listener(next(iter(inodes.values())))


def _cmdline(pid_dir: Path) -> str:
    try:
        return (pid_dir / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"


def _dspark_serve_ancestor(pid: int, proc: Path, node: str) -> int | None:
    """The `dspark serve` of `node` at or above `pid` (vLLM runs as its child), or None. A
    serve whose command line names another node (--node/-n) is not this node's."""
    for _ in range(32):
        words = _cmdline(proc / str(pid)).split()
        if "serve" in words and any(w.endswith("dspark") or w == "dspark" for w in words):
            named = [words[i + 1] for i, w in enumerate(words[:-1]) if w in ("--node", "-n")]
            named += [w.split("=", 1)[1] for w in words if w.startswith("--node=")]
            return pid if not named or node in named else None
        try:
            stat = (proc / str(pid) / "stat").read_text()
            pid = int(stat.rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return None
        if pid <= 1:
            return None
    return None


def node_ports(cluster: Cluster, node: NodeConfig) -> list[tuple[str, str, int]]:
    """(what, bind address, port) this node's processes listen on."""
    out = [("agent_port", node.agent_bind, node.agent_port)]
    if node.is_head:
        out += [("master_port", node.address, node.master_port), ("api_port", node.api_bind, node.api_port)]
    return out


@dataclass(frozen=True)
class PortUse:
    """One of this node's ports as a test bind found it."""

    what: str                      # agent_port, master_port, api_port
    host: str
    port: int
    error: OSError | None = None   # the test bind's error; None: free
    owner: Listener | None = None  # who listens there (EADDRINUSE), where /proc shows it
    ours: str | None = None        # held by this node's own dspark: which, in words

    @property
    def name(self) -> str:
        """The check's name: port.agent, port.master, port.api."""
        return f"port.{self.what.removesuffix('_port')}"

    @property
    def held(self) -> bool:
        """Held by another process: a condition that can clear (`dspark serve --check` waits)."""
        return self.error is not None and self.error.errno == errno.EADDRINUSE and self.ours is None

    def holder(self) -> str:
        return self.owner.describe() if self.owner else "a process this user cannot see (another user's)"


def probe_ports(cluster: Cluster, node: NodeConfig, proc: Path, own_state: dict | None) -> list[PortUse]:
    """A test bind of each of this node's ports, and who holds the ones in use."""
    out = []
    for what, host, port in node_ports(cluster, node):
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
                out.append(PortUse(what, host, port))
                continue
            except OSError as e:
                err = e
        if err.errno != errno.EADDRINUSE:
            out.append(PortUse(what, host, port, err))
            continue
        owner = _listener_owner(host, port, proc)
        serve_pid = _dspark_serve_ancestor(owner.pid, proc, node.name) if owner and owner.pid else None
        ours = None
        if serve_pid is not None:
            ours = f"dspark serve (pid {serve_pid})"
        elif what == "agent_port" and own_state is not None:
            ours = f"agent ({own_state.get('state')})"
        out.append(PortUse(what, host, port, err, owner, ours))
    return out


def check_ports(cluster: Cluster, node: NodeConfig, proc: Path, own_state: dict | None) -> list[Check]:
    """Each port free (a test bind), or held by this node's own dspark."""
    out = []
    for u in probe_ports(cluster, node, proc, own_state):
        where = f"{u.host}:{u.port}"
        if u.error is None:
            out.append(ok(u.name, f"{where} is free"))
        elif u.ours is not None:
            out.append(ok(u.name, f"{where} is held by this node's own {u.ours}"))
        elif u.error.errno == errno.EADDRNOTAVAIL:
            out.append(fail(u.name, f"cannot bind {where}: {u.host} is not an address of this host",
                            f"configure {u.host} on this host, or correct node {node.name!r}"))
        elif u.error.errno != errno.EADDRINUSE:
            out.append(fail(u.name, f"cannot bind {where}: {u.error.strerror}", "see the error"))
        else:
            out.append(fail(u.name, f"{where} is in use by {u.holder()}",
                            f"stop that process, or give node {node.name!r} another {u.what}"))
    return out


def check_api_access(node: NodeConfig, environ: Mapping[str, str]) -> list[Check]:
    """Who can reach the head's API: closed (the fabric address, loopback) or guarded by an API
    key is ok; bound wider without a key (in this environment: DSPARK_API_KEY, VLLM_API_KEY,
    the 'api-key' credential or DSPARK_API_KEY_FILE) is a warn saying how to close it."""
    from dspark.config.credentials import API_KEY_FILE_ENV, read_api_key

    bind, port = node.api_bind, node.api_port
    try:
        ip = ipaddress.ip_address(bind)
    except ValueError:
        ip = None
    if bind == node.address:
        return [ok("api.access", f"the API binds the fabric address {bind} only: the nodes reach it, other "
                                 "networks do not")]
    if ip is not None and ip.is_loopback:
        return [ok("api.access", f"the API binds {bind} (loopback): only this host reaches it")]
    wide = "every interface of this host" if ip is not None and ip.is_unspecified else f"{bind}, not the fabric address"
    if read_api_key(dict(environ)) or environ.get(API_KEY_FILE_ENV):
        return [ok("api.access", f"the API binds {wide}; clients need the API key")]
    return [warn("api.access", f"the API is open: it binds {wide} (port {port}) and no API key is set, so "
                               "anyone who reaches this host can use the model",
                 f"bind it to the fabric address (remove api_host from node {node.name!r}) or to loopback "
                 "(api_host = \"127.0.0.1\"), or set an API key: DSPARK_API_KEY in the service's environment "
                 "file, or services.dspark.apiKeyFile on NixOS (this check sees a key only in its own "
                 "environment; the units' `dspark serve --check` runs with it)")]


# ------------------------------------------------------------------------------ peers
def own_agent_state(node: NodeConfig) -> dict | None:
    """This node's /state when its own agent answers as this node (its dspark serve runs)."""
    from dspark.node.agent_client import agent_state

    s = agent_state(node.agent_url, timeout=1.0)
    return s if s is not None and s.get("node") == node.name else None


def check_peers(cluster: Cluster, node: NodeConfig, mine: dict, starting: bool = False) -> list[Check]:
    """Compare with every other node whose agent answers. `starting`: this node is about to
    start, when a worker does not expect its head yet (workers start first)."""
    from dspark.node.agent_client import fetch_state

    out: list[Check] = []
    for peer in cluster.nodes:
        if peer.name == node.name:
            continue
        t0 = time.time()
        answer = fetch_state(peer.agent_url, timeout=2.0)
        t1 = time.time()
        name = f"peer.{peer.name}"
        s = answer.state
        if s is None:
            if starting and peer.is_head and not node.is_head:
                out.append(ok(name, f"the head's agent ({peer.agent_url}) is not up: it starts after the workers and "
                              "compares itself with them then"))
            elif starting and not peer.is_head and not node.is_head:
                out.append(ok(name, f"{peer.name}'s agent ({peer.agent_url}) is not up: workers start in any "
                              "order, and the head compares itself with each of them when it starts"))
            else:
                out.append(warn(name, f"{peer.agent_url} does not answer ({answer.error or 'no state'}): cluster "
                                "file, runtime, model and clock not compared", f"start {peer.name} first "
                                "(workers before the head), or check the fabric between the nodes"))
            continue
        theirs = s.get("identity") or {}
        line = s.get("runtime_line") or theirs.get("runtime_line")
        follows = _follows(name, node, peer, mine, theirs, line)
        if not theirs:
            out.append(warn(name, f"{peer.name}'s agent reports no identity (an older dspark?)",
                            "install the same dspark on every node"))
        else:
            out += _compare(name, peer.name, mine, theirs, runtime=follows is None)
        out += [follows] if follows else _compare_line(name, peer.name, mine.get("runtime_line"), line)
        if s.get("dspark_version") and s.get("dspark_version") != _dspark_version():
            out.append(warn(f"{name}.dspark", f"{peer.name} runs dspark {s.get('dspark_version')}, this node "
                            f"{_dspark_version()}", "install the same dspark on every node"))
        peer_time = s.get("time")
        if isinstance(peer_time, (int, float)) and not isinstance(peer_time, bool):
            offset = peer_time - (t0 + t1) / 2
            bound = (t1 - t0) / 2
            seen = f"{peer.name}'s clock is {offset:+.3f} s from this node's (round trip {t1 - t0:.3f} s)"
            if abs(offset) - bound > CLOCK_TOLERANCE_S:
                out.append(warn(f"{name}.clock", seen + f", more than {CLOCK_TOLERANCE_S:g} s",
                                "run NTP on both nodes (`timedatectl set-ntp true`; chrony or systemd-timesyncd)"))
            else:
                out.append(ok(f"{name}.clock", seen))
    return out


def _dspark_version() -> str:
    from dspark import __version__

    return __version__


def _compare_line(name: str, peer: str, mine: str | None, theirs: str | None) -> list[Check]:
    """The runtime line each node runs: one pair, one line (an engine cannot span two releases)."""
    label = f"{name}.line"
    theirs = theirs if isinstance(theirs, str) and theirs else None
    if not mine and not theirs:
        return []  # neither side names one (identities from before runtime lines): the runtime row compares
    if not mine or not theirs:
        return [warn(label, f"runtime line not known on {'this node' if not mine else peer} (an older dspark?)",
                     "install the same dspark on every node")]
    if mine != theirs:
        return [fail(label, f"{peer} runs runtime line {theirs}, this node {mine}: a pair does not form on two lines",
                     "put every node on one line: the same serving.runtime_line (the same cluster file) on "
                     "every node, then restart the workers first, the head last")]
    return [ok(label, f"same runtime line as {peer}: {mine}")]


def _follows(name: str, node: NodeConfig, peer: NodeConfig, mine: dict, theirs: dict, line: object) -> Check | None:
    """Two lines of one cluster file are not a refusal: the workers follow their head's line when
    the pair forms (node_policy: a worker switches to it, the head does not refuse it). So a node
    restarted on its own while the pair switches lines, or rolls a switch back, rejoins; a refusal
    (exit 2) is never restarted by systemd. The runtimes then differ as their lines do, and are
    compared once both run one line."""
    mine_line, sha = mine.get("runtime_line"), mine.get("cluster_sha256")
    if (not isinstance(line, str) or not line or not mine_line or line == mine_line or not sha
            or sha != theirs.get("cluster_sha256")):
        return None
    onto = (f"this worker follows its head onto {line}" if peer.is_head else
            f"{peer.name} follows this head onto {mine_line}" if node.is_head else "both follow the head's line")
    return ok(f"{name}.line", f"{peer.name} runs runtime line {line}, this node {mine_line}, from the same cluster "
              f"file: {onto} when the pair forms (runtimes compared once both run one line)")


def _compare(name: str, peer: str, mine: dict, theirs: dict, runtime: bool = True) -> list[Check]:
    out = []
    rows = [
        ("cluster", "cluster_sha256", "cluster file", "copy the same cluster file to every node (NixOS: the same "
         "services.dspark.settings), then restart both"),
        ("model", "model_sha256", "model directory (config.json, index, shard names and sizes)",
         "the same download on every node: compare `ls -l` of model.path on both"),
        ("runtime", "vllm_sources_sha256", "vLLM sources (version and overlay)", "install the same runtime on every "
         "node (the same flake revision, or `dspark overlay apply` on both)"),
    ]
    for short, key, what, fix in (r for r in rows if runtime or r[0] != "runtime"):
        a, b = mine.get(key), theirs.get(key)
        label = f"{name}.{short}"
        if a is None or b is None:
            out.append(warn(label, f"{what} not known on {'this node' if a is None else peer}",
                            "see that node's own check"))
        elif a != b:
            extra = ""
            if short == "runtime":
                extra = f" (vLLM {mine.get('vllm_version')} here, {theirs.get('vllm_version')} on {peer})"
            out.append(fail(label, f"{peer} differs in {what}{extra}: {b[:12]} there, {a[:12]} here", fix))
        else:
            extra = f": vLLM {mine.get('vllm_version')}" if short == "runtime" else ""
            out.append(ok(label, f"same {what} as {peer}{extra} ({a[:12]})"))
    return out
