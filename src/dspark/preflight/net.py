"""The fabric: the node's address on its socket interface, the interface's link, the RDMA
device, its port and RoCE v2 GID, and the running kernel against the kernels known to break
RoCE. Everything is read from a /sys and a /proc tree (roots passed in, so tests build their
own), except which interface holds which IPv4 address: the kernel keeps that in neither tree
and says it over netlink (`netlink_addresses`)."""

from __future__ import annotations

import ipaddress
import socket
import struct
import tomllib
from collections.abc import Mapping
from importlib import resources
from pathlib import Path

from dspark.config.schema import NodeConfig
from dspark.preflight.result import Check, fail, ok, warn

IFF_UP = 0x1
# /sys/class/net/<if>/operstate values that carry traffic; "unknown" is what lo and some
# virtual links report while up (RFC 2863 operStatus).
OPER_UP = ("up", "unknown")


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


def _is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


# ------------------------------------------------------------------------------ addresses
def netlink_addresses(timeout_s: float = 2.0) -> dict[str, list[str]]:
    """Interface name -> its addresses (IPv4 and IPv6), from the kernel over NETLINK_ROUTE
    (RTM_GETADDR), as `ip addr` reads them. Raises OSError when netlink is not available."""
    nlmsg_done, nlmsg_error, rtm_newaddr, rtm_getaddr = 3, 2, 20, 22
    ifa_address, ifa_local = 1, 2
    out: dict[str, list[str]] = {}
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE) as s:
        s.settimeout(timeout_s)
        s.bind((0, 0))
        s.send(struct.pack("=IHHII", 24, rtm_getaddr, 0x1 | 0x300, 1, 0) + struct.pack("=BBBBI", 0, 0, 0, 0, 0))
        for _ in range(10000):  # bounded: a dump ends with NLMSG_DONE long before this
            data = s.recv(1 << 16)
            off = 0
            while off + 16 <= len(data):
                length, kind = struct.unpack_from("=IH", data, off)
                if length < 16:
                    return out
                if kind == nlmsg_done:
                    return out
                if kind == nlmsg_error:
                    (errno,) = struct.unpack_from("=i", data, off + 16)
                    raise OSError(-errno, "netlink RTM_GETADDR failed")
                if kind == rtm_newaddr:
                    family, _plen, _flags, _scope, index = struct.unpack_from("=BBBBI", data, off + 16)
                    attrs, pos, end = {}, off + 24, off + length
                    while pos + 4 <= end:
                        rta_len, rta_type = struct.unpack_from("=HH", data, pos)
                        if rta_len < 4:
                            break
                        attrs[rta_type] = data[pos + 4:pos + rta_len]
                        pos += (rta_len + 3) & ~3
                    raw = attrs.get(ifa_local) or attrs.get(ifa_address)
                    if raw is not None and family in (socket.AF_INET, socket.AF_INET6):
                        try:
                            name = socket.if_indextoname(index)
                        except OSError:
                            name = f"#{index}"
                        out.setdefault(name, []).append(socket.inet_ntop(family, raw))
                off += (length + 3) & ~3
    return out


def default_route_interfaces(proc: Path) -> set[str]:
    """Interfaces that carry a default route (/proc/net/route and /proc/net/ipv6_route)."""
    found: set[str] = set()
    text = _read(proc / "net" / "route") or ""
    for line in text.splitlines()[1:]:
        f = line.split()
        if len(f) >= 8 and f[1] == "00000000" and f[7] == "00000000" and int(f[3], 16) & 0x1:
            found.add(f[0])
    text = _read(proc / "net" / "ipv6_route") or ""
    for line in text.splitlines():
        f = line.split()
        # dest, dest prefix, src, src prefix, next hop, metric, refcnt, use, flags, device
        if len(f) >= 10 and f[0] == "0" * 32 and f[1] == "00" and f[9] != "lo" and int(f[8], 16) & 0x1:
            found.add(f[9])
    return found


def _holder(address: str, addresses: Mapping[str, list[str]]) -> str | None:
    want = ipaddress.ip_address(address)
    for ifname, addrs in addresses.items():
        for a in addrs:
            try:
                if ipaddress.ip_address(a.split("%")[0]) == want:
                    return ifname
            except ValueError:
                continue
    return None


# ------------------------------------------------------------------------------ interface
def check_interface(node: NodeConfig, sys_root: Path, proc: Path, addresses: Mapping[str, list[str]] | None,
                    ) -> list[Check]:
    """The address on socket_ifname; that interface up, not wireless, not the default route's."""
    ifname, addr = node.socket_ifname, node.address
    net = sys_root / "class" / "net"
    if ifname is None:
        holder = _holder(addr, addresses) if addresses is not None else None
        if _is_loopback(addr):
            return [ok("net.address", f"{addr} is a loopback address (a pair on one host): no fabric interface")]
        where = f" ({addr} is on {holder})" if holder else ""
        return [warn("net.address", f"socket_ifname is not set{where}: NCCL, Gloo and vLLM's TP sockets pick "
                     "an interface themselves (they have picked Wi-Fi or the management NIC)",
                     f"set socket_ifname = \"{holder or 'FABRIC-INTERFACE'}\" in node {node.name!r}")]
    out: list[Check] = []
    if not (net / ifname).exists():
        names = sorted(p.name for p in net.iterdir()) if net.is_dir() else []
        return [fail("net.address", f"no interface {ifname!r} on this host (interfaces: {', '.join(names) or 'none'})",
                     f"set socket_ifname in node {node.name!r} to the fabric interface that holds {addr}")]
    if addresses is None:
        out.append(warn("net.address", f"cannot list this host's addresses (netlink unavailable): {addr} on "
                        f"{ifname} not verified", "run `ip -br addr` and compare"))
    else:
        holder = _holder(addr, addresses)
        if holder == ifname:
            out.append(ok("net.address", f"{addr} is on {ifname}"))
        else:
            has = ", ".join(addresses.get(ifname, [])) or "no address"
            where = f"{addr} is on {holder}" if holder else f"{addr} is on no interface of this host"
            out.append(fail("net.address", f"{where}; {ifname} has {has}",
                            f"configure {addr} on {ifname} (e.g. `ip addr add {addr}/24 dev {ifname}`, or the "
                            f"host's network configuration), or correct address / socket_ifname in node {node.name!r}"))
    d = net / ifname
    flags = _read(d / "flags")
    oper, mtu, carrier = _read(d / "operstate"), _read(d / "mtu"), _read(d / "carrier")
    up = flags is not None and int(flags, 16) & IFF_UP and oper in OPER_UP
    mtu_text = f"MTU {mtu}" if mtu else "MTU unknown"
    if up:
        out.append(ok("net.link", f"{ifname} is up ({oper}), {mtu_text}"))
    else:
        why = "administratively down" if flags is not None and not int(flags, 16) & IFF_UP else f"operstate {oper}"
        if carrier == "0":
            why += ", no carrier (cable or peer port down)"
        out.append(fail("net.link", f"{ifname} is not up: {why}; {mtu_text}",
                        f"`ip link set {ifname} up`, and check the cable to the peer node"))
    if (d / "wireless").exists() or (d / "phy80211").exists():
        out.append(fail("net.wireless", f"{ifname} is a wireless interface",
                        "put the fabric on the wired link between the nodes (the QSFP/ConnectX port), "
                        f"and set socket_ifname and address in node {node.name!r} to it"))
    else:
        out.append(ok("net.wireless", f"{ifname} is not wireless"))
    defaults = default_route_interfaces(proc)
    if ifname in defaults:
        if node.allow_default_route:
            out.append(ok("net.default-route", f"{ifname} carries the default route (allowed: allow_default_route)"))
        else:
            out.append(fail("net.default-route", f"{ifname} carries this host's default route: the management or "
                            "internet link, not a dedicated fabric",
                            "use the dedicated link between the nodes; if this interface is that link, set "
                            f"allow_default_route = true in node {node.name!r}"))
    else:
        out.append(ok("net.default-route", f"{ifname} does not carry the default route"
                      + (f" ({', '.join(sorted(defaults))} does)" if defaults else "")))
    return out


# ------------------------------------------------------------------------------ RDMA
def check_rdma(node: NodeConfig, sys_root: Path) -> list[Check]:
    """The RDMA device exists, port 1 is ACTIVE, and the GID NCCL will use is the address's
    RoCE v2 GID (the index `auto` resolves to: dspark.node.rdma.resolve_gid_index)."""
    from dspark.node.rdma import resolve_gid_index

    dev = node.rdma_device
    ib = sys_root / "class" / "infiniband"
    if dev is None:
        if _is_loopback(node.address):
            return [ok("rdma.device", "no rdma_device (a pair on one host: NCCL uses sockets)")]
        return [warn("rdma.device", "rdma_device is not set: NCCL falls back to TCP sockets or picks an HCA itself",
                     "set rdma_device (see `ls /sys/class/infiniband`) and gid_index = \"auto\" "
                     f"in node {node.name!r}")]
    if not (ib / dev).is_dir():
        names = ", ".join(sorted(p.name for p in ib.iterdir())) if ib.is_dir() else ""
        return [fail("rdma.device", f"no RDMA device {dev!r} (devices: {names or 'none: is mlx5_ib loaded?'})",
                     f"set rdma_device in node {node.name!r} to the device of the fabric port")]
    port = ib / dev / "ports" / "1"
    layer = _read(port / "link_layer") or "unknown"
    ndevs = sorted({v for v in (_read(p) for p in (port / "gid_attrs" / "ndevs").glob("*")) if v}) \
        if (port / "gid_attrs" / "ndevs").is_dir() else []
    out = [ok("rdma.device", f"{dev} ({layer}" + (f", on {', '.join(ndevs)}" if ndevs else "") + ")")]
    state, phys = _read(port / "state") or "unknown", _read(port / "phys_state") or "unknown"
    if state.endswith("ACTIVE"):
        out.append(ok("rdma.port", f"{dev} port 1 is {state} ({phys})"))
    else:
        out.append(fail("rdma.port", f"{dev} port 1 is {state} ({phys})",
                        "bring the fabric link up (cable, `ip link set <netdev> up`) until the port is ACTIVE"))
    if layer != "Ethernet":
        out.append(ok("rdma.gid", f"link layer {layer}: no RoCE GID to check"))
        return out
    if _is_loopback(node.address) or ":" in node.address:
        return out + [warn("rdma.gid", f"{node.address} has no IPv4 RoCE v2 GID to look up",
                           "give gid_index as a number (show_gids lists them)")]
    want = resolve_gid_index(dev, node.address, ib)
    gids = port / "gids"

    def describe(idx: str) -> str:
        gid = _read(gids / idx) or "?"
        kind = _read(port / "gid_attrs" / "types" / idx) or "?"
        nd = _read(port / "gid_attrs" / "ndevs" / idx)
        return f"{gid} ({kind}{', ' + nd if nd else ''})"

    if want is None:
        out.append(fail("rdma.gid", f"no RoCE v2 GID for {node.address} on {dev}",
                        f"configure {node.address} on the netdev of {dev}"
                        + (f" ({', '.join(ndevs)})" if ndevs else "") + "; the GID table follows the addresses"))
        return out
    nd = _read(port / "gid_attrs" / "ndevs" / want)
    if node.gid_index in (None, "auto"):
        how = "auto resolves to" if node.gid_index == "auto" else "gid_index is not set; the RoCE v2 GID is"
        out.append(ok("rdma.gid", f"{how} index {want}: {describe(want)}"))
    elif node.gid_index == want:
        out.append(ok("rdma.gid", f"gid_index {want} is {describe(want)}"))
    else:
        out.append(fail("rdma.gid", f"gid_index {node.gid_index} is {describe(node.gid_index)}; the RoCE v2 GID of "
                        f"{node.address} is index {want}", f"write gid_index = \"auto\" (or \"{want}\") in node "
                        f"{node.name!r}: the index differs between nodes and can change after a reboot"))
    if nd and node.socket_ifname and nd != node.socket_ifname:
        out.append(warn("rdma.netdev", f"{dev}'s GID for {node.address} is on {nd}, the sockets on "
                        f"{node.socket_ifname}", f"set socket_ifname = \"{nd}\" so that NCCL's sockets and RDMA "
                        "use the same link"))
    return out


# ------------------------------------------------------------------------------ kernel
def known_kernels() -> dict:
    """dspark/data/roce_kernels.toml: [[broken]] and [[worked]] entries, each with its source."""
    text = resources.files("dspark").joinpath("data/roce_kernels.toml").read_text(encoding="utf-8")
    return tomllib.loads(text)


def check_kernel(node: NodeConfig, proc: Path, table: dict | None = None) -> list[Check]:
    release = _read(proc / "sys" / "kernel" / "osrelease")
    if not release:
        return [warn("kernel", "cannot read the kernel release (/proc/sys/kernel/osrelease)", "run `uname -r`")]
    table = known_kernels() if table is None else table
    cmdline = (_read(proc / "cmdline") or "").split()
    uses_rdma = node.rdma_device is not None
    for entry in table.get("broken", []):
        if release != entry["release"]:
            continue
        seen = f"{release} is known to break RoCE: {entry['symptom']} ({entry['source']})"
        cleared = entry.get("cleared_by")
        if cleared and cleared in cmdline:
            return [warn("kernel", seen + f"; {cleared} is on the kernel command line, the reported workaround",
                         entry["fix"])]
        if not uses_rdma:
            return [warn("kernel", seen + "; this node uses no RDMA device", entry["fix"])]
        return [fail("kernel", seen, entry["fix"])]
    for entry in table.get("worked", []):
        if release == entry["release"]:
            return [ok("kernel", f"{release}: known to work with RoCE ({entry['source']})")]
    return [ok("kernel", f"{release}: not among the kernels known to break RoCE (dspark/data/roce_kernels.toml)")]
