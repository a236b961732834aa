"""The drop-ins that tie the units to the nodes a host runs (`dspark systemd install --node`):
which unit runs which node (the head's, the host's one worker, or an instance of the worker
template each for several), each node's DSPARK_NODE and DSPARK_CONFIG, and the ordering of a
host that runs the head and some of its workers. The units' own text is dspark.units.render's."""

from __future__ import annotations

from dataclasses import dataclass

from dspark.units.names import (
    DASHBOARD,
    DEFAULT_CONFIG,
    HEAD,
    INSTANCE_CHARS,
    LOCAL_PAIR_DROPIN,
    NODE_DROPIN,
    WAIT_WORKER,
    WORKER,
    WORKER_TEMPLATE,
)
from dspark.units.render import section


@dataclass(frozen=True)
class NodeRole:
    name: str
    is_head: bool


def worker_instance(name: str) -> str:
    """dspark-worker@NAME.service: the instance of the template that runs worker node NAME."""
    if not name or not set(name) <= INSTANCE_CHARS:
        bad = "".join(sorted(set(name) - INSTANCE_CHARS)) or "an empty name"
        raise ValueError(f"node {name!r} cannot name a {WORKER_TEMPLATE} instance ({bad!r} is not allowed): "
                         "a host running several workers names each unit and state directory by its node; "
                         "use letters, digits and - _ . : in the node names")
    return WORKER_TEMPLATE.replace("@", f"@{name}")


def node_units(nodes: list[NodeRole]) -> dict[str, str]:
    """Node name -> the unit that runs it on this host: the head's, dspark-worker.service for
    a host's one worker, an instance of dspark-worker@.service each for several."""
    workers = [n for n in nodes if not n.is_head]
    return {n.name: HEAD if n.is_head else WORKER if len(workers) == 1 else worker_instance(n.name)
            for n in nodes}


def node_dropins(nodes: list[NodeRole], config_path: str = DEFAULT_CONFIG) -> dict[str, str]:
    """Relative path -> text of the drop-ins for the nodes this host runs.

    Each node's unit gets its DSPARK_NODE and DSPARK_CONFIG; the head's helpers get the
    cluster file; a host running the head and some of its workers orders the head (and
    wait-worker) after every one of them (systemd ordering works within a host)."""
    heads = [n for n in nodes if n.is_head]
    workers = [n for n in nodes if not n.is_head]
    if len(heads) > 1:
        raise ValueError("a cluster has one head (rank 0): " + ", ".join(n.name for n in heads) + " are all heads")
    names = [n.name for n in nodes]
    if len(set(names)) != len(names):
        raise ValueError("each node once: " + ", ".join(sorted({x for x in names if names.count(x) > 1}))
                         + " given more than once")
    units = node_units(nodes)
    env = _environment("DSPARK_CONFIG", config_path)
    out: dict[str, str] = {}
    for n in nodes:
        out[f"{units[n.name]}.d/{NODE_DROPIN}"] = (
            f"# Written by `dspark systemd install`: this host runs node {n.name!r}.\n"
            + section("Service", [_environment("DSPARK_NODE", n.name), env]))
    if heads:
        for unit in (WAIT_WORKER, DASHBOARD):
            out[f"{unit}.d/{NODE_DROPIN}"] = ("# Written by `dspark systemd install`: the cluster file.\n"
                                              + section("Service", [env]))
    if len(nodes) > 1:
        local = [units[w.name] for w in workers]
        why = ("# Written by `dspark systemd install`: this host runs several nodes ("
               + ", ".join(names) + ").\n")
        # Their vLLMs see one /dev/shm, so vLLM treats them as one node and also talks over
        # IPC sockets in /tmp: a private /tmp per unit would hang the rendezvous. They share
        # the host's /tmp instead (still writable under ProtectSystem=strict).
        shared_tmp = ["# Several nodes on one host: vLLM's IPC sockets in /tmp must be shared (one /dev/shm).",
                      "PrivateTmp=no", "ReadWritePaths=/tmp /var/tmp"]
        for w in workers:
            out[f"{units[w.name]}.d/{LOCAL_PAIR_DROPIN}"] = why + section("Service", shared_tmp)
        if heads:
            order = ["# `systemctl start dspark-head` starts this host's workers first (READY=1: in the",
                     "# rendezvous); workers on other hosts are waited for by dspark-wait-worker.",
                     "Wants=" + " ".join(local), "After=" + " ".join(local)]
            out[f"{HEAD}.d/{LOCAL_PAIR_DROPIN}"] = (why + section("Unit", order) + "\n"
                                                    + section("Service", shared_tmp))
            out[f"{WAIT_WORKER}.d/{LOCAL_PAIR_DROPIN}"] = why + section("Unit", ["After=" + " ".join(local)])
    return out


def _environment(name: str, value: str) -> str:
    """An Environment= line. systemd splits its value at blanks unless the assignment is in
    double quotes, where it reads C escapes (\\ and \"); it resolves specifiers (%) but not
    variables ($ is plain). A path with a space is fine; a newline or NUL cannot be written."""
    if any(c in value for c in "\n\r\0"):
        raise ValueError(f"unsupported character (newline or NUL) in {value!r} for a unit file")
    assignment = f"{name}={value}".replace("%", "%%")
    if any(c in assignment for c in " \t\"'\\"):
        assignment = '"' + assignment.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return f"Environment={assignment}"
