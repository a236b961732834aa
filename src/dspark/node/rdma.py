"""RoCE GIDs as sysfs shows them: which GID index carries a node's address. Read by the
supervisor at each launch (NCCL_IB_GID_INDEX for `gid_index = "auto"`) and by `dspark check`
(preflight.net), without either importing the other."""

from __future__ import annotations

from pathlib import Path


def resolve_gid_index(device: str, address: str, sysfs: Path = Path("/sys/class/infiniband")) -> str | None:
    """The GID index of `device` port 1 that carries `address` as a RoCE v2 IPv4 GID.

    The index can change after a reboot, so it is looked up at each launch (a stale shared
    NCCL_IB_GID_INDEX has wedged NCCL)."""
    import ipaddress

    port = sysfs / device / "ports" / "1"
    mapped = ipaddress.IPv6Address("::ffff:" + address).exploded  # IPv4-mapped GID form
    gids = port / "gids"
    if not gids.is_dir():
        return None
    for entry in sorted(gids.iterdir(), key=lambda p: int(p.name) if p.name.isdigit() else -1):
        try:
            gid = entry.read_text().strip()
            kind = (port / "gid_attrs" / "types" / entry.name).read_text().strip()
        except OSError:
            continue
        if gid.replace(":", "") == mapped.replace(":", "") and "v2" in kind.lower():
            return entry.name
    return None
