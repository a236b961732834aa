"""`dspark check`: the host preflight. What wedges two-node GB10 deployments in the public
record is mostly the host, not vLLM; each check here looks at one such cause before vLLM
starts and says ok, warn or fail, what it saw and the fix.

  net.py        the fabric address on socket_ifname, the link, wireless, the default route;
                the RDMA device, port and RoCE v2 GID; the kernel against data/roce_kernels.toml
  host.py       the GPU and driver (NVML, nvidia_uvm loaded), free memory against the plan,
                swap and OOM killers, the units' cache directories
  model_dir.py  config.json, the shards the index names, readable by the service user, whole
  node_identity.py  this node's identity (served in the agent's /state), its runtime line
  ports.py      this node's ports (free, or who holds them), who can reach the head's API
  peer.py       the peers: the same cluster file, runtime, model and dspark; their clocks
  perms.py      who else can write the model directory, the cluster file and vLLM's runtime

Run on demand (`dspark check`), by `dspark serve --check` (what the units run: a fail
refuses the start with exit 2, except a port another process holds: `gate` waits for it) and
by `dspark local up` before each node starts. Every check takes its roots (/sys, /proc) from
`Host`, so tests build their own trees.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from dspark.config.schema import Cluster, NodeConfig
from dspark.preflight.result import Check, Report, fail, ok, warn

if TYPE_CHECKING:
    from dspark.preflight.ports import PortUse

T = TypeVar("T")


@dataclass
class Host:
    """Where the checks look. The defaults are this machine."""

    sys: Path = Path("/sys")
    proc: Path = Path("/proc")
    environ: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))
    # Interface name -> addresses; None: ask the kernel (netlink).
    addresses: Callable[[], dict[str, list[str]]] | None = None
    nvml: Callable[[], dict] | None = None
    peers: bool = True       # compare with the peers' agents
    starting: bool = False   # this node is about to start (serve --check, local up): the head is
                             # not expected up yet when a worker starts
    identity: dict | None = None  # this node's identity, when already known

    @property
    def under_unit(self) -> bool:
        """Running as a dspark unit: systemd set $INVOCATION_ID and $CACHE_DIRECTORY."""
        return bool(self.environ.get("INVOCATION_ID") and self.environ.get("CACHE_DIRECTORY"))


def _guard(name: str, fn: Callable[[], list[Check]]) -> list[Check]:
    """A check that breaks reports itself as a fail line, never a traceback."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 (the boundary: every other check still runs)
        return [fail(name, f"the check itself failed: {type(e).__name__}: {e}", "report this as a dspark bug")]


def run(cluster: Cluster, node: NodeConfig, host: Host | None = None) -> Report:
    """Every check for `node` on this host, in the order a reader fixes them."""
    from dspark.preflight import host as H
    from dspark.preflight import model_dir as M
    from dspark.preflight import net as N
    from dspark.preflight import node_identity as NI
    from dspark.preflight import peer as P
    from dspark.preflight import ports as PO
    from dspark.units import user as U
    from dspark.units.names import USER

    host = host or Host()
    report = Report(node.name)
    add = report.checks.extend

    def addresses() -> dict[str, list[str]] | None:
        try:
            return (host.addresses or N.netlink_addresses)()
        except OSError:
            return None

    add(_guard("net", lambda: N.check_interface(node, host.sys, host.proc, addresses())))
    add(_guard("rdma", lambda: N.check_rdma(node, host.sys)))
    add(_guard("kernel", lambda: N.check_kernel(node, host.proc)))

    nvml: dict = {}

    def gpu() -> list[Check]:
        nvml.update((host.nvml or H.read_nvml)())
        return H.check_gpu(nvml, cluster.serving.gpus_per_node)

    add(_guard("gpu", gpu))
    add(_guard("gpu.uvm", lambda: H.check_uvm(nvml, host.sys, host.proc, host.under_unit)))
    own = _guard_value(lambda: P.own_agent_state(node)) if host.peers else None
    running = None
    if own and own.get("vllm_pid"):
        running = f"pid {own['vllm_pid']}, {own.get('state')}"
    if own and own.get("runtime_line") not in (None, cluster.serving.runtime_line):
        # This node runs another line than the file's (dspark switch): check and compare that one.
        cluster = _guard_value(lambda: cluster.on_line(own["runtime_line"])) or cluster

    user = U.service_user(USER, host.under_unit)
    facts_box: list = [None]

    def model() -> list[Check]:
        checks, facts_box[0] = M.check_model_dir(cluster.model.path, cluster.serving.load_format, user)
        return checks + M.vision_checks(cluster.model.path, cluster.serving.runtime_line)

    add(_guard("model", model))

    def memory() -> list[Check]:
        from dspark.plan.facts import PlanError
        from dspark.plan.fit import plan_from_facts
        from dspark.plan.from_cluster import plan_inputs

        need, why = None, "the model directory did not pass"
        if facts_box[0] is not None or cluster.serving.load_format == "dummy":
            try:
                if facts_box[0] is not None:
                    plan = plan_from_facts(facts_box[0], plan_inputs(cluster))
                else:
                    from dspark.plan.from_cluster import plan_for_cluster

                    plan = plan_for_cluster(cluster)
                need = plan.memory_per_rank_bytes
            except PlanError as e:
                why = str(e)
            except (KeyError, TypeError, ValueError) as e:  # a config.json the plan cannot read
                why = f"the plan cannot read {cluster.model.path}/config.json: {type(e).__name__} {e}"
        return H.check_memory(need, why, nvml, host.proc, running)

    add(_guard("memory.free", memory))
    add(_guard("memory", lambda: H.check_swap_oom(host.proc)))
    add(_guard("cache", lambda: H.check_caches(host.environ, host.under_unit)))
    add(_guard("port", lambda: PO.check_ports(cluster, node, host.proc, own)))
    if node.is_head:
        add(_guard("api.access", lambda: PO.check_api_access(node, host.environ)))

    def perms() -> list[Check]:
        from dspark.preflight.perms import check_perms

        return check_perms(cluster, user, NI.vllm_package(cluster.serving.vllm_command)[1])

    add(_guard("perms", perms))
    identity = host.identity
    if identity is None:
        identity = _guard_value(lambda: NI.local_identity(cluster)) or {}
    report.identity = identity
    if identity.get("error"):
        report.checks.append(warn("runtime", f"vLLM's runtime not identified: {identity['error']}",
                                  "check serving.vllm_command (`dspark render` shows the command)"))
    else:
        report.checks.append(ok("runtime", f"vLLM {identity.get('vllm_version') or '?'}, sources "
                                f"{(identity.get('vllm_sources_sha256') or '?')[:12]} "
                                f"({identity.get('vllm_sources_files', 0)} files)"))
        report.checks += NI.check_runtime_line(cluster, identity)
    if host.peers:
        add(_guard("peer", lambda: P.check_peers(cluster, node, identity, host.starting)))
    return report


def _guard_value(fn: Callable[[], T]) -> T | None:
    try:
        return fn()
    except Exception:  # noqa: BLE001 (an optional fact: its absence is reported by the check using it)
        return None


# A port another process holds can clear (that process ends, or was only passing by in the
# 2 s between two starts): `serve --check` looks again after 1, 2, 4 ... 30 s.
PORT_RETRY_FIRST_S = 1.0
PORT_RETRY_MAX_S = 30.0


@dataclass(frozen=True)
class Verdict:
    """What `gate` decided: start (no refusal), or the refusal's message, and whether the
    refusal is for now only (`retry`: a port still held after the wait) or ended by a signal."""

    identity: dict
    refusal: str | None = None
    retry: bool = False
    signal: int | None = None


def gate(cluster: Cluster, node: NodeConfig, say: Callable[[str], None], host: Host | None = None, *,
         port_wait_s: float = 0.0, wait: Callable[[float], int | None] | None = None,
         waiting: Callable[[float, str], None] | None = None,
         clock: Callable[[], float] = time.monotonic) -> Verdict:
    """`dspark serve --check` (what the units run): every line to `say` (the journal under
    systemd), and the refusal when a check failed; the identity for the agent's /state as well.

    When the only fails are ports that other processes hold, they are looked at again with a
    growing delay for up to `port_wait_s`: a port that frees starts the node, one still held is a
    refusal with `retry` set. `wait(seconds)` sleeps and returns a signal that ends the wait
    early (default: time.sleep); `waiting(seconds, line)` is told each wait (default: `say`);
    `clock` measures the wait (tests pass a fake one with a `wait` that moves it)."""
    host = host or Host(starting=True)
    report = run(cluster, node, host)
    for line in report.lines():
        say(f"dspark[{node.name}]: check {line}")
    say(f"dspark[{node.name}]: check {report.summary()}")
    identity = report.identity or {}
    if not report.failed:
        return Verdict(identity)
    why = "; ".join(f"{c.name}: {c.seen} (fix: {c.fix})" for c in report.failed)
    refusal = Verdict(identity, f"refusing to start: dspark check failed: {why}")
    failed = {c.name for c in report.failed}
    if port_wait_s <= 0 or not all(c.name.startswith("port.") for c in report.failed):
        return refusal
    return _wait_for_ports(cluster, node, host, failed, port_wait_s, refusal, say, wait, waiting, clock)


def _wait_for_ports(cluster: Cluster, node: NodeConfig, host: Host, names: set[str], wait_s: float,
                    refusal: Verdict, say: Callable[[str], None], wait: Callable[[float], int | None] | None,
                    waiting: Callable[[float, str], None] | None, clock: Callable[[], float]) -> Verdict:
    from dspark.preflight.ports import probe_ports

    def sleep(seconds: float) -> int | None:
        time.sleep(seconds)
        return None

    wait, waiting = wait or sleep, waiting or (lambda _s, line: say(line))
    t0, delay = clock(), PORT_RETRY_FIRST_S
    while True:
        blocking = [u for u in probe_ports(cluster, node, host.proc, None)
                    if u.name in names and u.error is not None and u.ours is None]
        if not blocking:
            say(f"dspark[{node.name}]: {', '.join(sorted(names))}: free now")
            return Verdict(refusal.identity)
        if not all(u.held for u in blocking):  # not in use: an address gone, a bind refused
            return refusal
        left = wait_s - (clock() - t0)
        if left <= 0:
            fixes = "; ".join(dict.fromkeys(f"stop that process, or give node {node.name!r} another {u.what}"
                                            for u in blocking))
            return Verdict(refusal.identity, f"refusing to start for now: after {wait_s:g} s, "
                           f"{_held(blocking, 'still ')} (fix: {fixes})", retry=True)
        step = min(delay, left)
        waiting(step, f"dspark[{node.name}]: {_held(blocking, '')}; retrying in {step:.3g} s "
                      f"(for {left:.0f} s more)")
        sig = wait(step)
        if sig is not None:
            return Verdict(refusal.identity, f"stopped while waiting for {', '.join(sorted(names))}", signal=sig)
        delay = min(delay * 2, PORT_RETRY_MAX_S)


def _held(ports: Iterable[PortUse], still: str) -> str:
    return "; ".join(f"{u.name}: {u.host}:{u.port} is {still}held by {u.holder()}" for u in ports)


def identity(cluster: Cluster) -> dict:
    """This node's identity without the checks (`dspark serve` without --check)."""
    from dspark.preflight.node_identity import local_identity

    return _guard_value(lambda: local_identity(cluster)) or {}
