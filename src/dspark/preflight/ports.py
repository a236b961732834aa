"""This node's ports (a test bind of each, and who holds the ones in use, as far as /proc shows
it) and who can reach the head's API."""

from __future__ import annotations

import errno
import ipaddress
import os
import pwd
import socket
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from dspark.config.schema import Cluster, NodeConfig
from dspark.preflight.result import Check, fail, ok, warn


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
