"""The systemd units of a dspark node: one source for their text (`dspark systemd render`).

This module renders (pure text); `unit_install` writes and reloads, `units_cli` is the
`dspark systemd` command group, `unit_names` holds the names and paths.

  dspark-worker.service        a worker (rank >= 1): `dspark serve`, Type=notify
  dspark-worker@.service       the same, one instance per worker node, named by the node
                               (dspark-worker@spark-c.service): for a host that runs several
                               workers (the local 4-node appliance, a box with several GPUs)
  dspark-head.service          the head (rank 0): `dspark serve`, Type=notify;
                               Requires= and After= dspark-worker-ready.target
  dspark-worker-ready.target   reached once dspark-wait-worker.service has succeeded
  dspark-wait-worker.service   oneshot `dspark wait-worker`: every worker's agent in the
                               rendezvous; workers on other hosts are out of reach of systemd
                               ordering, their agents are not
  dspark-dashboard.service     `dspark dashboard`, on the head's host

The units name no node and no cluster: `dspark serve` reads DSPARK_NODE and DSPARK_CONFIG
from its environment. The NixOS module sets them in the units it enables (the package ships
these texts under lib/systemd/system); on other hosts `dspark systemd install --node NAME`
writes the units plus a drop-in per node (`units.dropins.node_dropins`). A host runs its one worker as
dspark-worker.service, and several workers as instances of dspark-worker@.service (each
with its own state directory). A host that runs the head and some of its workers gets one
more drop-in that orders the head (and wait-worker) directly after those local workers.

Restart policy. `Restart=on-failure` restarts a node after exit 3 (never ready) or 4 (died,
lost its pair), a crash or a watchdog timeout; never after exit 2 (refused: a bad cluster
file is not fixed by retrying). The growing, bounded delay between attempts lives in the
supervisor (`supervisor.backoff_delay`, from the failure history in the state directory,
announced as a STATUS= line), not in RestartSteps=/RestartMaxDelaySec=: those arrived in
systemd 254, and DGX OS / Debian 12 run 252, where an unknown key is ignored with a warning
and the unit would fall back to a fixed delay. One mechanism that works and shows itself in
`systemctl status` on every host beats two that differ.

How a ring of N nodes comes back after one of them dies. Every unit restarts on its own
(Restart=on-failure) and the supervisors put the restarts in order: the node whose vLLM died
exits 4; the head sees it (a failed liveness probe, or that worker's agent restarted or gone)
and exits 4; every other worker sees its head leave and exits 4; each comes back, the workers
into the rendezvous, and the head's supervisor starts vLLM only once every worker's agent
reports the rendezvous. No BindsTo= or PartOf= between the node units, on purpose: systemd
orders only jobs queued together, not one unit's automatic restart against another's, and
BindsTo= would turn a worker's failure into a clean stop of the head, which Restart=on-failure
never restarts; the head would stay down. The local-nodes drop-in's Wants=/After= only make
`systemctl start dspark-head` start this host's workers first.
"""

from __future__ import annotations

from dspark.units.names import (
    CACHE_ENV,
    DASHBOARD,
    DEFAULT_CONFIG,
    HEAD,
    READY_TARGET,
    USER,
    WAIT_WORKER,
    WORKER,
    WORKER_TEMPLATE,
)

# WATCHDOG=1 goes out every WatchdogSec/2, and on the head only while a liveness round found
# the engine alive (its counters moving while busy, a 1-token completion while idle: see
# dspark.node.liveness) within liveness_interval_s + liveness_timeout_s (15 s by default). Under
# the watchdog it is the one enforcer of liveness: a hung vLLM stops the pings and systemd
# restarts the unit at most WatchdogSec later (result 'watchdog'). 10 s leaves room for a
# supervisor loop slowed by a loaded host (its agent polls may take a few seconds); 5 s
# fired spuriously on a two-core machine running two pairs.
WATCHDOG_S = 10
# Covers the start until the supervisor's first EXTEND_TIMEOUT_USEC; from then on it extends
# the start by 90 s every 30 s while the model loads (bounded by ready_timeout_s).
START_TIMEOUT = "5min"
# Above the default drain of a planned stop (drain_s, 60 s) plus the grace after it
# (stop_grace_s, 30 s), the sweep of vLLM's process group (up to 15 s) and the 1.5 s the agent
# keeps answering "stopped"; larger settings are covered by the supervisor's
# EXTEND_TIMEOUT_USEC when it starts draining or stopping.
STOP_TIMEOUT_S = 120
RESTART_SEC = 2
# A safety net only: with the supervisor's backoff (0, 5, 10, 20, ... 300 s) ten starts need
# more than 15 minutes, so this trips only if the backoff cannot work (state dir unwritable).
START_LIMIT = ("10min", 10)

# Only the NVIDIA and RDMA character devices (resolved by name from /proc/devices at start).
DEVICES = (
    ("char-nvidia-frontend", "/dev/nvidia0.., /dev/nvidiactl, /dev/nvidia-modeset"),
    ("char-nvidia-uvm", "/dev/nvidia-uvm, /dev/nvidia-uvm-tools"),
    ("char-nvidia-caps", "/dev/nvidia-caps/*"),
    ("char-infiniband_verbs", "/dev/infiniband/uverbs*: NCCL over RoCE"),
    ("/dev/infiniband/rdma_cm", "RDMA connection manager"),
)


def section(name: str, lines: list[str]) -> str:
    return f"[{name}]\n" + "\n".join(lines) + "\n"


def _unit(*sections: str, header: str) -> str:
    return header + "\n" + "\n".join(sections)


def exec_quote(word: str) -> str:
    """One word of an Exec*= line: specifiers (%) and variables ($) escaped, quoted when it
    has blanks, quotes or backslashes."""
    word = word.replace("%", "%%").replace("$", "$$")
    if not word or any(c in word for c in " \t\"'\\;"):
        return '"' + word.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return word


def exec_path(path: str) -> str:
    """The executable of an Exec*= line. systemd resolves specifiers (%) in it but no
    variables: `$$` would stay two dollars in the path it runs (systemd-analyze verify:
    "Command /opt/a$$b/dspark is not executable"), so only % is escaped here."""
    word = path.replace("%", "%%")
    if any(c in word for c in "\n\0"):
        raise ValueError(f"unsupported character in {path!r} for a unit file")
    if not word or any(c in word for c in " \t\"'\\;"):
        return '"' + word.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return word


def _header(what: str) -> str:
    return (f"# {what}\n"
            "# Rendered by `dspark systemd render`; change dspark, not this file (drop-ins go in\n"
            "# the unit's .d directory).\n")


def _common_hardening(devices: bool) -> list[str]:
    """The sandbox of every dspark service. `systemd-analyze security` rates the node units 1.5
    (3.5 before the hardening; nixpkgs' CUDA services reach 1.5); each setting it still counts
    as exposed carries its reason here (tests/systemd/test_units_hardening.py checks both)."""
    lines = [
        "# Hardening. Everything is read-only but the state and cache directories.",
        "ProtectSystem=strict",
        "# Exposed, on purpose: ProtectHome= is read-only, as model directories may live under",
        "# /home on DGX OS: readable, never writable.",
        "ProtectHome=read-only",
        "PrivateTmp=yes",
        "# The unit's mounts stay its own (mounts on the host still reach it: a model on NFS).",
        "PrivateMounts=yes",
        "# A user namespace that maps only root and the dspark user. The kernel still checks",
        "# files and devices against the real user and groups (video included), so the GPU and",
        "# RDMA device nodes stay usable; other users' files and groups show as nobody/nogroup.",
        "PrivateUsers=yes",
        "NoNewPrivileges=yes",
        "CapabilityBoundingSet=",
        "AmbientCapabilities=",
        "ProtectKernelTunables=yes",
        "# The NVIDIA and RDMA modules are loaded at boot (nvidia-modprobe is setuid, which",
        "# NoNewPrivileges forbids anyway); `dspark check` (gpu.uvm) fails the start when",
        "# nvidia_uvm is not loaded.",
        "ProtectKernelModules=yes",
        "ProtectKernelLogs=yes",
        "ProtectControlGroups=yes",
        "ProtectClock=yes",
        "ProtectHostname=yes",
        "# Other users' processes are invisible (the supervisor only watches its own vLLM).",
        "ProtectProc=invisible",
        "# Exposed, on purpose: ProcSubset=pid would hide /proc/meminfo, /proc/cpuinfo and",
        "# /proc/net, which vLLM, torch (memory, CPU features) and `dspark check` (memory, ports,",
        "# routes, kernel) read.",
        "ProcSubset=all",
        "RestrictNamespaces=yes",
        "RestrictRealtime=yes",
        "RestrictSUIDSGID=yes",
        "LockPersonality=yes",
        "# SysV and POSIX IPC (/dev/shm: vLLM's and NCCL's segments) of user dspark go once the",
        "# last unit running as dspark stops (systemd counts the units per user), so a host",
        "# running several nodes keeps the others' segments while one restarts.",
        "RemoveIPC=yes",
        "SystemCallArchitectures=native",
        "# SystemCallFilter=: the calls of a system service (@system-service), less the privileged",
        "# ones (@privileged: set*uid, chown, mount, modules, clock, swap, reboot, raw I/O, bpf) and",
        "# without ptrace and perf (@debug). Exposed, on purpose: @resources, which it includes:",
        "# vLLM raises RLIMIT_NOFILE (setrlimit) and pins its workers to the GPU's CPUs",
        "# (sched_setaffinity), torch and OpenMP set thread affinity, NUMA placement uses",
        "# mbind/set_mempolicy. CUDA, NCCL, RDMA verbs and Triton's JIT use ioctl, mmap, mlock,",
        "# memfd and execve of the compiler, all in @system-service; pidfd_getfd (@debug) is out",
        "# (torch's sharing of expandable CUDA segments between processes would need it). A call",
        "# outside the list fails with EPERM instead of killing the process: an error, not a crash.",
        "SystemCallFilter=@system-service",
        "SystemCallFilter=~@privileged",
        "SystemCallErrorNumber=EPERM",
        "# Exposed, on purpose: RestrictAddressFamilies= keeps AF_NETLINK (libibverbs enumerates",
        "# RDMA devices over NETLINK_RDMA, NCCL and Gloo list interfaces), AF_INET and AF_INET6",
        "# (API, agents, rendezvous, NCCL and Gloo sockets) and AF_UNIX (vLLM's engine IPC, NCCL's",
        "# proxy, sd_notify). No IPAddressDeny=/IPAddressAllow=: the API's clients and the",
        "# fabric's addresses are the operator's to choose (the firewall's job).",
        "RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6 AF_NETLINK",
        "UMask=0077",
        "# Exposed, on purpose: MemoryDenyWriteExecute= is off (Triton, torch.compile and CUDA's",
        "# PTX JIT write executable code); PrivateNetwork= is off (a network service); no",
        "# RootDirectory=/RootImage= (the runtime lives on the host or in the Nix store).",
    ]
    if devices:
        lines += [
            "# Exposed, on purpose: PrivateDevices= would hide the GPU: off, and a closed",
            "# DeviceAllow= list instead (nvidia-uvm: `dspark check` fails the start without it).",
            "PrivateDevices=no",
            "DevicePolicy=closed",
        ]
        for spec, why in DEVICES:
            lines += [f"# {why}", f"DeviceAllow={spec} rw"]
    else:
        lines.append("PrivateDevices=yes")
    return lines


def node_service(role: str, dspark_bin: str, template: bool = False) -> str:
    """dspark-head.service, dspark-worker.service, or (a worker, `template`) the template
    dspark-worker@.service whose instance name is the worker's node name."""
    head = role == "head"
    unit = [
        f"Description=dspark {role} node{' %i' if template else ''} "
        f"({'rank 0, serves the API' if head else 'rank >= 1, headless'}): vLLM under the dspark supervisor",
        "After=network-online.target" + (f" {READY_TARGET}" if head else ""),
        "Wants=network-online.target",
    ]
    if head:
        unit += [
            "# The workers run on other hosts: this target is reached once `dspark wait-worker`",
            "# sees every worker's agent in the rendezvous (bounded by worker_wait_timeout_s).",
            "# After a restart the supervisor itself waits for all of them again before vLLM.",
            f"Requires={READY_TARGET}",
        ]
    unit += [
        f"StartLimitIntervalSec={START_LIMIT[0]}",
        f"StartLimitBurst={START_LIMIT[1]}",
    ]
    # Each instance of the template keeps its own failure history and start count.
    state_name = f"{role}-%i" if template else role
    state = f"%S/dspark/{state_name}"
    if template:
        node_env = [
            "Environment=DSPARK_NODE=%i",
            "# The instance name is the node's name (dspark-worker@spark-c: node spark-c); the",
            "# drop-in `dspark systemd install` writes per instance states it once more, exactly.",
        ]
    else:
        node_env = [
            "# DSPARK_NODE (this node's name; default: the host name) comes from the NixOS module",
            "# or the drop-in `dspark systemd install --node NAME` writes.",
        ]
    service = [
        "Type=notify",
        "# The supervisor is the only sender (vLLM, its child, never sees NOTIFY_SOCKET).",
        "NotifyAccess=main",
        "# --check: `dspark check` before vLLM starts (fabric, RDMA, kernel, GPU, memory, model,",
        "# caches, ports, peers); a fail exits 2 (no restart) with the reason as the last lines",
        "# of the journal, shown by `systemctl status`; warnings are logged.",
        f"ExecStart={exec_path(dspark_bin)} serve --check --state-dir {state}",
        f"Environment=DSPARK_CONFIG={DEFAULT_CONFIG}",
        *node_env,
        f"SyslogIdentifier={'dspark-%i' if template else f'dspark-{role}'}",
        "",
        "# Timeouts: the supervisor sends EXTEND_TIMEOUT_USEC while the model loads, and",
        "# WATCHDOG=1 only while the node is truly alive (the head: real completions).",
        f"TimeoutStartSec={START_TIMEOUT}",
        f"WatchdogSec={WATCHDOG_S}s",
        f"TimeoutStopSec={STOP_TIMEOUT_S}s",
        "",
        "# Restarts: exit 3 (never ready), 4 (died or lost its pair), crashes and watchdog",
        "# timeouts; never exit 2 (refused: bad cluster file or memory plan). The delay grows",
        "# inside the supervisor (0, 5, 10 ... 300 s, shown as STATUS=): RestartSteps= needs",
        "# systemd >= 254, DGX OS has 252. Each node restarts on its own; the supervisors",
        "# re-form the ring, workers first (why: dspark/units.py).",
        "Restart=on-failure",
        f"RestartSec={RESTART_SEC}s",
        "RestartPreventExitStatus=2",
        "# SIGTERM to the supervisor alone: the head drains its requests in flight (drain_s),",
        "# then it stops vLLM's process group within stop_grace_s; whatever is left when it",
        "# exits gets SIGKILL.",
        "KillMode=mixed",
        "# The supervisor reacts to a vLLM process killed by the OOM killer (exit 4, restart).",
        "OOMPolicy=continue",
        "",
        f"User={USER}",
        f"Group={USER}",
        f"StateDirectory=dspark dspark/{state_name}",
        "CacheDirectory=dspark",
        "Environment=HOME=%S/dspark",
        *[f"Environment={k}={v}" for k, v in CACHE_ENV],
        "",
        "# RDMA registers (pins) large buffers.",
        "LimitMEMLOCK=infinity",
        "# vLLM, NCCL and torch open many files and run many threads.",
        "LimitNOFILE=65536",
        "TasksMax=16384",
        "",
        *_common_hardening(devices=True),
    ]
    if template:
        what = f"{WORKER_TEMPLATE}: one of this host's worker nodes of a dspark cluster (instance: the node's name)."
    else:
        what = f"dspark-{role}.service: this host's {role} node of a dspark cluster."
    return _unit(section("Unit", unit), section("Service", service),
                 section("Install", ["WantedBy=multi-user.target"]),
                 header=_header(what))


def ready_target() -> str:
    unit = [
        "Description=dspark: every worker node is in the rendezvous",
        f"Requires={WAIT_WORKER}",
        f"After={WAIT_WORKER}",
        "# Re-checked on the next start of the head once nothing needs it.",
        "StopWhenUnneeded=yes",
    ]
    return _unit(section("Unit", unit), header=_header(f"{READY_TARGET}: reached by {WAIT_WORKER}."))


def wait_worker_service(dspark_bin: str) -> str:
    unit = [
        "Description=dspark: wait until every worker node is in the rendezvous",
        "After=network-online.target",
        "Wants=network-online.target",
        "StopWhenUnneeded=yes",
    ]
    service = [
        "Type=oneshot",
        "RemainAfterExit=yes",
        f"ExecStart={exec_path(dspark_bin)} wait-worker",
        f"Environment=DSPARK_CONFIG={DEFAULT_CONFIG}",
        "# STATUS= lines say whom it waits for.",
        "NotifyAccess=main",
        "# Bounded by the cluster file's worker_wait_timeout_s (one place for it): `dspark",
        "# wait-worker` then exits 1 and says why, and the head's start fails on the dependency.",
        "TimeoutStartSec=infinity",
        "SyslogIdentifier=dspark-wait-worker",
        f"User={USER}",
        f"Group={USER}",
        "",
        *_common_hardening(devices=False),
    ]
    return _unit(section("Unit", unit), section("Service", service),
                 header=_header(f"{WAIT_WORKER}: the oneshot behind {READY_TARGET}."))


def dashboard_service(dspark_bin: str) -> str:
    unit = [
        "Description=dspark dashboard: live view of the pair",
        "After=network-online.target",
        "Wants=network-online.target",
    ]
    service = [
        f"ExecStart={exec_path(dspark_bin)} dashboard",
        f"Environment=DSPARK_CONFIG={DEFAULT_CONFIG}",
        "SyslogIdentifier=dspark-dashboard",
        "Restart=on-failure",
        "RestartSec=5s",
        f"User={USER}",
        f"Group={USER}",
        "",
        *_common_hardening(devices=False),
    ]
    return _unit(section("Unit", unit), section("Service", service),
                 section("Install", ["WantedBy=multi-user.target"]),
                 header=_header(f"{DASHBOARD}: a read-only client of the agents and the head's API."))


def render_units(dspark_bin: str) -> dict[str, str]:
    """File name -> text of every unit, for a dspark executable at `dspark_bin`."""
    return {
        WORKER: node_service("worker", dspark_bin),
        WORKER_TEMPLATE: node_service("worker", dspark_bin, template=True),
        HEAD: node_service("head", dspark_bin),
        READY_TARGET: ready_target(),
        WAIT_WORKER: wait_worker_service(dspark_bin),
        DASHBOARD: dashboard_service(dspark_bin),
    }


def sysusers() -> str:
    """systemd-sysusers(8) entry for the units' user (the NixOS module declares it itself)."""
    return ("# The dspark user (written by `dspark systemd install`). The NVIDIA device nodes may\n"
            "# belong to the video group.\n"
            f'u {USER} - "dspark node (DeepSeek V4 Flash)" /var/lib/dspark\n'
            f"m {USER} video\n")
