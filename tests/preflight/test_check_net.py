"""dspark check: the fabric interface, RDMA device, RoCE GID and kernel, against /sys and /proc
trees built here as real directories (the checks take their roots)."""

from __future__ import annotations

import ipaddress
import json
import shutil
import socket
import subprocess
from pathlib import Path

import pytest

from dspark.config import validate as C
from dspark.config.schema import ConfigError, NodeConfig
from dspark.preflight import Host, run
from dspark.preflight import net as N

ADDR = "192.168.100.10"


def node(**kw) -> NodeConfig:
    base = {"name": "spark-a", "rank": 0, "address": ADDR, "socket_ifname": "fab0"}
    base.update(kw)
    return NodeConfig(**base)


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def netdev(sys_root: Path, name: str, *, flags="0x1003", oper="up", mtu=9000, carrier="1", wireless=False) -> None:
    d = sys_root / "class" / "net" / name
    write(d / "flags", flags + "\n")
    write(d / "operstate", oper + "\n")
    write(d / "mtu", f"{mtu}\n")
    write(d / "carrier", carrier + "\n")
    if wireless:
        (d / "wireless").mkdir()


ROUTE_HEAD = "Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT\n"


def routes(proc: Path, default_if: str | None = "eth0", v6_default: str | None = None) -> None:
    lines = [ROUTE_HEAD]
    if default_if:
        lines.append(f"{default_if}\t00000000\t010200C0\t0003\t0\t0\t0\t00000000\t0\t0\t0\n")
    lines.append("fab0\t0064A8C0\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0\n")
    write(proc / "net" / "route", "".join(lines))
    v6 = "fe800000000000000000000000000000 40 00000000000000000000000000000000 00 " \
         "00000000000000000000000000000000 00000100 00000001 00000000 00000001     fab0\n"
    if v6_default:
        v6 += "00000000000000000000000000000000 00 00000000000000000000000000000000 00 " \
              f"fd000000000000000000000000000001 00000400 00000003 00000000 00000003     {v6_default}\n"
    write(proc / "net" / "ipv6_route", v6)


@pytest.fixture
def tree(tmp_path):
    sys_root, proc = tmp_path / "sys", tmp_path / "proc"
    netdev(sys_root, "fab0")
    netdev(sys_root, "eth0", mtu=1500)
    netdev(sys_root, "wlan0", wireless=True)
    routes(proc)
    return sys_root, proc


ADDRS = {"fab0": [ADDR, "fe80::1"], "eth0": ["10.0.0.5"], "lo": ["127.0.0.1", "::1"]}


def by_name(checks):
    return {c.name: c for c in checks}


# ------------------------------------------------------------------------------ interface
def test_fabric_interface_all_ok(tree):
    sys_root, proc = tree
    got = by_name(N.check_interface(node(), sys_root, proc, ADDRS))
    assert {c.status for c in got.values()} == {"ok"}
    assert f"{ADDR} is on fab0" in got["net.address"].seen
    assert "MTU 9000" in got["net.link"].seen  # the MTU is reported
    assert "eth0 does" in got["net.default-route"].seen


def test_address_on_another_interface_fails_naming_it(tree):
    sys_root, proc = tree
    addrs = {"fab0": ["10.9.9.9"], "eth0": [ADDR]}
    c = by_name(N.check_interface(node(), sys_root, proc, addrs))["net.address"]
    assert c.status == "fail" and "is on eth0" in c.seen and "fab0 has 10.9.9.9" in c.seen
    assert "ip addr add" in c.fix


def test_address_nowhere_fails(tree):
    sys_root, proc = tree
    c = by_name(N.check_interface(node(), sys_root, proc, {"fab0": [], "eth0": ["10.0.0.5"]}))["net.address"]
    assert c.status == "fail" and "on no interface of this host" in c.seen


def test_interface_missing_lists_the_hosts_interfaces(tree):
    sys_root, proc = tree
    [c] = N.check_interface(node(socket_ifname="enp1s0f0np0"), sys_root, proc, ADDRS)
    assert c.status == "fail" and "eth0, fab0, wlan0" in c.seen


def test_link_administratively_down(tree):
    sys_root, proc = tree
    netdev(sys_root, "fab0", flags="0x1002", oper="down", carrier="0")
    c = by_name(N.check_interface(node(), sys_root, proc, ADDRS))["net.link"]
    assert c.status == "fail" and "administratively down" in c.seen and "ip link set fab0 up" in c.fix


def test_link_up_but_no_carrier(tree):
    sys_root, proc = tree
    netdev(sys_root, "fab0", flags="0x1003", oper="down", carrier="0")
    c = by_name(N.check_interface(node(), sys_root, proc, ADDRS))["net.link"]
    assert c.status == "fail" and "no carrier" in c.seen


def test_loopback_style_operstate_unknown_is_up(tree):
    sys_root, proc = tree
    netdev(sys_root, "fab0", flags="0x9", oper="unknown")
    assert by_name(N.check_interface(node(), sys_root, proc, ADDRS))["net.link"].status == "ok"


def test_wireless_interface_fails(tree):
    sys_root, proc = tree
    addrs = {"wlan0": [ADDR]}
    c = by_name(N.check_interface(node(socket_ifname="wlan0"), sys_root, proc, addrs))["net.wireless"]
    assert c.status == "fail" and "wireless" in c.seen


def test_default_route_interface_fails_unless_allowed(tree):
    sys_root, proc = tree
    routes(proc, default_if="fab0")
    c = by_name(N.check_interface(node(), sys_root, proc, ADDRS))["net.default-route"]
    assert c.status == "fail" and "allow_default_route = true" in c.fix
    c = by_name(N.check_interface(node(allow_default_route=True), sys_root, proc, ADDRS))["net.default-route"]
    assert c.status == "ok" and "allowed" in c.seen


def test_ipv6_default_route_counts(tree):
    sys_root, proc = tree
    routes(proc, default_if=None, v6_default="fab0")
    assert N.default_route_interfaces(proc) == {"fab0"}
    assert by_name(N.check_interface(node(), sys_root, proc, ADDRS))["net.default-route"].status == "fail"


def test_no_socket_ifname_warns_and_names_the_holder(tree):
    sys_root, proc = tree
    [c] = N.check_interface(node(socket_ifname=None), sys_root, proc, ADDRS)
    assert c.status == "warn" and 'socket_ifname = "fab0"' in c.fix


def test_loopback_pair_needs_no_interface(tree):
    sys_root, proc = tree
    [c] = N.check_interface(node(socket_ifname=None, address="127.0.0.2"), sys_root, proc, ADDRS)
    assert c.status == "ok"


def test_allow_default_route_is_validated():
    base = {"model": {"path": "/m"}, "nodes": [
        {"name": "a", "rank": 0, "address": "10.0.0.1", "allow_default_route": True},
        {"name": "b", "rank": 1, "address": "10.0.0.2", "allow_default_route": "yes"}]}
    with pytest.raises(ConfigError) as e:
        C.from_dict(base)
    assert any("allow_default_route: expected true or false" in p for p in e.value.problems)
    base["nodes"][1]["allow_default_route"] = False
    with pytest.raises(ConfigError) as e:
        C.from_dict(base)
    assert any("no socket_ifname is set" in p for p in e.value.problems)
    base["nodes"][0]["socket_ifname"] = "eth0"
    assert C.from_dict(base).nodes[0].allow_default_route is True


# ------------------------------------------------------------------------------ netlink
def test_netlink_addresses_of_this_host():
    got = N.netlink_addresses()
    assert "127.0.0.1" in got.get("lo", [])
    ip = shutil.which("ip")
    if ip:  # iproute2 reads the same netlink dump: both must agree
        r = subprocess.run([ip, "-j", "addr"], capture_output=True, text=True, timeout=10)
        if r.returncode == 0:
            want = {i["ifname"]: sorted(a["local"] for a in i.get("addr_info", [])) for i in json.loads(r.stdout)}
            assert {k: sorted(v) for k, v in got.items() if k in want} == {k: v for k, v in want.items() if v}


# ------------------------------------------------------------------------------ RDMA and GID
def ib_tree(sys_root: Path, dev="roce0", state="4: ACTIVE", gids=None, netdev_name="fab0") -> Path:
    port = sys_root / "class" / "infiniband" / dev / "ports" / "1"
    write(port / "state", state + "\n")
    write(port / "phys_state", ("5: LinkUp" if "ACTIVE" in state else "3: Disabled") + "\n")
    write(port / "link_layer", "Ethernet\n")
    mapped = ipaddress.IPv6Address("::ffff:" + ADDR).exploded
    gids = gids if gids is not None else [
        ("fe80:0000:0000:0000:0000:00ff:fe00:0001", "IB/RoCE v1"),
        ("fe80:0000:0000:0000:0000:00ff:fe00:0001", "RoCE v2"),
        (mapped, "IB/RoCE v1"),
        (mapped, "RoCE v2"),
    ]
    for i, (gid, kind) in enumerate(gids):
        write(port / "gids" / str(i), gid + "\n")
        write(port / "gid_attrs" / "types" / str(i), kind + "\n")
        write(port / "gid_attrs" / "ndevs" / str(i), netdev_name + "\n")
    return port


def rdma_node(**kw):
    return node(rdma_device="roce0", gid_index="auto", **kw)


def test_rdma_active_and_auto_gid(tmp_path):
    ib_tree(tmp_path)
    got = by_name(N.check_rdma(rdma_node(), tmp_path))
    assert [c.status for c in got.values()] == ["ok", "ok", "ok"]
    assert "on fab0" in got["rdma.device"].seen
    assert "ACTIVE" in got["rdma.port"].seen
    assert "auto resolves to index 3" in got["rdma.gid"].seen and "RoCE v2" in got["rdma.gid"].seen


def test_numeric_gid_index_of_the_v1_entry_fails_naming_the_v2_index(tmp_path):
    ib_tree(tmp_path)
    c = by_name(N.check_rdma(node(rdma_device="roce0", gid_index="2"), tmp_path))["rdma.gid"]
    assert c.status == "fail" and "IB/RoCE v1" in c.seen and "index 3" in c.seen and 'gid_index = "auto"' in c.fix
    assert by_name(N.check_rdma(node(rdma_device="roce0", gid_index="3"), tmp_path))["rdma.gid"].status == "ok"


def test_no_gid_for_the_address_fails(tmp_path):
    ib_tree(tmp_path, gids=[("fe80:0000:0000:0000:0000:00ff:fe00:0001", "RoCE v2")])
    c = by_name(N.check_rdma(rdma_node(), tmp_path))["rdma.gid"]
    assert c.status == "fail" and f"no RoCE v2 GID for {ADDR}" in c.seen


def test_port_down_fails(tmp_path):
    ib_tree(tmp_path, state="1: DOWN")
    c = by_name(N.check_rdma(rdma_node(), tmp_path))["rdma.port"]
    assert c.status == "fail" and "1: DOWN" in c.seen


def test_missing_device_lists_devices(tmp_path):
    ib_tree(tmp_path, dev="rocep1s0f0")
    [c] = N.check_rdma(rdma_node(), tmp_path)
    assert c.status == "fail" and "rocep1s0f0" in c.seen


def test_gid_on_another_netdev_than_the_sockets_warns(tmp_path):
    ib_tree(tmp_path, netdev_name="fab1")
    c = by_name(N.check_rdma(rdma_node(), tmp_path))["rdma.netdev"]
    assert c.status == "warn" and 'socket_ifname = "fab1"' in c.fix


def test_no_rdma_device_warns_off_loopback(tmp_path):
    [c] = N.check_rdma(node(), tmp_path)
    assert c.status == "warn"
    [c] = N.check_rdma(node(address="127.0.0.1", socket_ifname=None), tmp_path)
    assert c.status == "ok"


# ------------------------------------------------------------------------------ kernel
def kernel(proc: Path, release: str, cmdline: str = "BOOT_IMAGE=/vmlinuz ro quiet") -> Path:
    write(proc / "sys" / "kernel" / "osrelease", release + "\n")
    write(proc / "cmdline", cmdline + "\n")
    return proc


def test_known_broken_kernel_fails_with_its_source(tmp_path):
    [c] = N.check_kernel(rdma_node(), kernel(tmp_path, "7.0.0-1019-nvidia"))
    assert c.status == "fail"
    assert "ibv_reg_mr_iova2" in c.seen and "https://github.com/" in c.seen
    assert "6.17.0-1032-nvidia" in c.fix


def test_known_broken_kernel_only_warns_without_rdma(tmp_path):
    [c] = N.check_kernel(node(), kernel(tmp_path, "7.0.0-1019-nvidia"))
    assert c.status == "warn" and "uses no RDMA" in c.seen


def test_reported_workaround_on_the_command_line_downgrades_to_warn(tmp_path):
    [c] = N.check_kernel(rdma_node(), kernel(tmp_path, "7.0.0-31-generic"))
    assert c.status == "fail"
    [c] = N.check_kernel(rdma_node(), kernel(tmp_path, "7.0.0-31-generic", "ro quiet kho=off"))
    assert c.status == "warn" and "kho=off" in c.seen


def test_known_good_and_unknown_kernels(tmp_path):
    [c] = N.check_kernel(rdma_node(), kernel(tmp_path, "6.17.0-1032-nvidia"))
    assert c.status == "ok" and "known to work" in c.seen
    [c] = N.check_kernel(rdma_node(), kernel(tmp_path, "7.0.0-10190-nvidia"))  # not a prefix match
    assert c.status == "ok" and "not among" in c.seen


def test_kernel_data_file_has_a_source_for_every_entry():
    table = N.known_kernels()  # read from the installed package (package-data)
    entries = table["broken"] + table["worked"]
    assert len(table["broken"]) >= 1 and len(table["worked"]) >= 1
    for e in entries:
        assert e["release"] and e["symptom"] and e["source"].startswith("https://")
    for e in table["broken"]:
        assert e["fix"]
    releases = {e["release"] for e in table["broken"]}
    assert "7.0.0-1019-nvidia" in releases  # the public record's entry
    assert "6.17.0-1032-nvidia" in {e["release"] for e in table["worked"]}


def test_this_hosts_kernel_is_read():
    [c] = N.check_kernel(node(), Path("/proc"))
    assert c.status in ("ok", "warn") and c.seen.startswith(Path("/proc/sys/kernel/osrelease").read_text().strip())


# ------------------------------------------------------------------------------ run() on a built tree
def test_run_on_a_built_host_reports_every_fabric_fault(tmp_path):
    sys_root, proc = tmp_path / "sys", tmp_path / "proc"
    netdev(sys_root, "fab0", flags="0x1002", oper="down", carrier="0")
    routes(proc, default_if="fab0")
    ib_tree(sys_root, state="1: DOWN")
    kernel(proc, "7.0.0-1019-nvidia")
    write(proc / "meminfo", "MemTotal: 131072000 kB\nMemAvailable: 120000000 kB\n")
    write(proc / "swaps", "Filename\tType\tSize\tUsed\tPriority\n")
    cluster = C.from_dict({"model": {"path": str(tmp_path / "nomodel")}, "nodes": [
        {"name": "spark-a", "rank": 0, "address": ADDR, "socket_ifname": "fab0", "rdma_device": "roce0",
         "gid_index": "auto", "agent_host": "127.0.0.1", "agent_port": free_port(),
         "api_host": "127.0.0.1", "api_port": free_port(), "master_port": 25000},
        {"name": "spark-b", "rank": 1, "address": "192.168.100.11", "agent_host": "127.0.0.1",
         "agent_port": free_port()}]})
    host = Host(sys=sys_root, proc=proc, environ={}, addresses=lambda: dict(ADDRS),
                nvml=lambda: {"library": None}, peers=False, identity={})
    report = run(cluster, cluster.nodes[0], host)
    failed = {c.name for c in report.failed}
    assert {"net.link", "net.default-route", "rdma.port", "kernel", "model.dir"} <= failed
    assert "port.master" in failed  # 192.168.100.10 is not an address of this machine
    text = "\n".join(report.lines())
    assert "fix:" in text and "Traceback" not in text


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
