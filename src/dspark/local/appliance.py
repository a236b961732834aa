"""The local appliance: the GB10 pair (or ring of N nodes) on one machine, with the real vLLM
CPU build.

A generated cluster file (head on 127.0.0.1, rank r on 127.0.0.(r+1), tensor parallel over all
of them) and a tiny random-weight model, run through the very same `dspark serve` supervisors
as on the GB10 nodes: the workers first, then the head once every worker's agent reports the
rendezvous.
"""

from __future__ import annotations

import fcntl
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from dspark.config import validate as C
from dspark.config.schema import DEFAULT_CONFIG_PATH, GIB, Cluster, ConfigError, NodeConfig, SupervisorConfig
from dspark.config.template import dumps
from dspark.files import state_io
from dspark.lines import state as line_state
from dspark.local import model as local_model
from dspark.local import vision as local_vision
from dspark.local.model import TINY_MODEL
from dspark.node import states as A
from dspark.node.agent_client import agent_state
from dspark.node.notify import NOTIFY_ENV
from dspark.node.signals import SignalQueue
from dspark.node.vllm_process import end_group
from dspark.status import LOCAL_HEADER, cli_command

if TYPE_CHECKING:
    from dspark.preflight import Host

WORKER_ADDR = "127.0.0.2"
HEAD_ADDR = "127.0.0.1"
HEAD_NAME = "local-head"
WORKER_NAME = "local-worker"  # rank 1; ranks 2.. are local-worker-2, local-worker-3, ...
SERVED_NAME = "dspark-local"
DEFAULT_NODES = 2
DEFAULT_DIR = Path(".dspark/local")  # `local up --dir`, `local switch --dir`
MAX_NODES = 8

KV_CACHE_GIB = 1  # per rank; the CPU build takes it from VLLM_CPU_KVCACHE_SPACE
# The directory's lock: flock-held by `local up` for the appliance's whole life, its PID inside.
# One appliance per directory: a second `local up` there is refused (it would rewrite the running
# pair's cluster file, rotate its logs and delete its state); `local down` signals that PID.
LOCK_NAME = "local.lock"
STOP_GRACE_S = 40.0  # Pair.stop after a fault: every supervisor's time to exit (SIGTERM, then SIGKILL)
# A planned stop's bound beyond the head's drain_s + stop_grace_s: its sweep, its 1.5 s STOPPED
# linger, a worker's poll that sees it (1 s) and that worker's own stop (its vLLM killed at once).
STOP_MARGIN_S = 10.0
LOCK_RETRY_S = 1.0  # a `local down`/`local status` probe holds the lock for an instant: waited out


class LocalError(Exception):
    pass


@dataclass(frozen=True)
class LocalPorts:
    api: int = 8000
    master: int = 29500
    agent: int = 8890


def node_name(rank: int) -> str:
    return HEAD_NAME if rank == 0 else WORKER_NAME if rank == 1 else f"{WORKER_NAME}-{rank}"


def node_address(rank: int) -> str:
    return f"127.0.0.{rank + 1}"


def valid_node_counts() -> list[int]:
    """Node counts the tiny model can be split over with tensor parallelism (one rank per node):
    those that divide its attention and KV heads."""
    heads = (TINY_MODEL["num_attention_heads"], TINY_MODEL["num_key_value_heads"])
    return [n for n in range(2, MAX_NODES + 1) if all(h % n == 0 for h in heads)]


def check_nodes(nodes: int) -> None:
    valid = valid_node_counts()
    if nodes not in valid:
        raise LocalError(f"--nodes {nodes}: the tiny local model has {TINY_MODEL['num_attention_heads']} "
                         f"attention heads, and tensor parallelism over N nodes needs N to divide them; "
                         f"choose one of {', '.join(map(str, valid))}")


def check_vision(line: str | None, nodes: int) -> None:
    """`--vision`: refused, before anything is written, on a line whose vLLM does not serve the
    tiny vision model (local_vision.SERVING_LINES) or a node count its heads cannot be split over."""
    from dspark.lines import runtime as runtime_lines

    lines = runtime_lines.load()
    line_id = lines.default if line is None else line
    if line_id not in local_vision.SERVING_LINES:
        able = ", ".join(f"{k} ({v})" for k, v in local_vision.SERVING_LINES.items())
        why = local_vision.NOT_SERVING.get(line_id, "not tried with it")
        raise LocalError(f"--vision: runtime line {line_id} (vLLM {lines.lines[line_id].vllm}) does not serve the "
                         f"tiny vision model ({why}); it is served by {able}: add --line "
                         f"{next(iter(local_vision.SERVING_LINES))}")
    if local_vision.HEADS % nodes:
        raise LocalError(f"--vision --nodes {nodes}: the tiny vision model has {local_vision.HEADS} attention heads, "
                         f"and tensor parallelism over N nodes needs N to divide them; it runs on "
                         f"{local_vision.HEADS} nodes")


def memory_per_node_gib(nodes: int = DEFAULT_NODES) -> float:
    """This machine's memory shared out among the local 'nodes'."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return round(int(line.split()[1]) / 1024**2 / nodes, 2)
    except OSError:
        pass
    return 4.0


# Where the other runtime lines' CPU builds are installed, one virtual environment each, beside
# this dspark's own (.ci/setup: .venv-lines/<line>/ beside .venv/); DSPARK_LINES_DIR overrides.
LINES_DIR_ENV = "DSPARK_LINES_DIR"


def lines_dir() -> Path:
    return Path(os.environ.get(LINES_DIR_ENV) or Path(sys.prefix).parent / ".venv-lines")


def vllm_command(line: str | None = None) -> list[str]:
    """vLLM's CLI of a runtime line: the default line's is the one in this dspark's own environment
    (the CPU build of the release the default line pins); another line's is in its own virtual
    environment under lines_dir(). Every installed line stays there side by side."""
    from dspark.lines import runtime as runtime_lines

    lines = runtime_lines.load()
    if line is None or line == lines.default:
        exe = Path(sys.executable).parent / "vllm"
        return [str(exe)] if exe.exists() else ["vllm"]
    if line not in lines.lines:
        raise LocalError(runtime_lines.unknown_line_message(line, lines).replace("serving.runtime_line", "--line"))
    exe = lines_dir() / line / "bin" / "vllm"
    if not exe.exists():
        raise LocalError(f"runtime line {line} (vLLM {lines.lines[line].vllm}) is not installed here: no {exe}; "
                         f".ci/setup installs its CPU build there ({LINES_DIR_ENV} names another folder)")
    return [str(exe)]


def installed_lines() -> dict[str, list[str]]:
    """Every runtime line installed here, with its vLLM command (what `dspark local switch` can
    move the appliance to)."""
    from dspark.lines import runtime as runtime_lines

    out = {}
    for line in runtime_lines.load().lines:
        try:
            out[line] = vllm_command(line)
        except LocalError:
            continue
    return out


def model_dir(workdir: Path, vision: bool = False) -> Path:
    """Where `local up` writes its tiny model (the text one, or the vision one with --vision):
    two directories, so neither holds the other's files."""
    return workdir / ("model-vision" if vision else "model")


def cluster_dict(workdir: Path, ports: LocalPorts = LocalPorts(), compile: bool = False,
                 nodes: int = DEFAULT_NODES, line: str | None = None, vision: bool = False) -> dict:
    check_nodes(nodes)
    command = vllm_command(line)  # refuses a line that is not installed, before anything is written
    if vision:
        check_vision(line, nodes)
    node_common = {"agent_port": ports.agent, "master_port": ports.master}
    # Tool calls as the tiny model's chat template writes them (local_model.TOOL_CALL_PARSER,
    # `hermes`); the GB10 defaults use the DeepSeek V4 parsers (config.SEED_EXTRA_ARGS). A named
    # or `required` tool choice is forced by a JSON schema; random weights given free whitespace
    # inside it fill max_tokens with blanks, so the local JSON is compact (xgrammar: a backend
    # that has the switch; vLLM applies it to plain JSON schemas only, not to the structural
    # tags of its strict tool calling, which is turned off in the env below).
    extra = ["--enable-auto-tool-choice", "--tool-call-parser", local_model.TOOL_CALL_PARSER,
             "--structured-outputs-config", '{"backend": "xgrammar", "disable_any_whitespace": true}']
    if not compile:
        extra += ["--optimization-level", "0"]  # skip torch.compile: minutes on 2 cores
    lines = installed_lines()
    if vision:
        # A switch can move the appliance only to a line that serves the vision model: the
        # others are left out of line_commands.
        lines = {k: v for k, v in lines.items() if k in local_vision.SERVING_LINES}
    return {
        "model": {"path": str(model_dir(workdir, vision)), "served_name": SERVED_NAME, "trust_remote_code": False},
        "serving": {
            "vllm_command": command,
            **({"runtime_line": line} if line is not None else {}),
            "line_commands": lines,
            "tensor_parallel_size": nodes,
            "gpus_per_node": 1,
            "usable_memory_gib": memory_per_node_gib(nodes),
            "max_model_len": 4096,
            "max_num_seqs": 16,
            "max_num_batched_tokens": 4096,
            "kv_cache_memory_bytes": KV_CACHE_GIB * GIB,
            # Stock vLLM choices in place of the GB10 overlay's (nvfp4_ds_mla, b12x, DSpark).
            "kv_cache_dtype": "auto",
            "block_size": 128,  # what vLLM's CPU platform uses
            "moe_backend": "auto",
            "speculative_config": {},
            # One image a prompt (what the tests send); the text model takes none.
            **({"limit_mm_per_prompt": {"image": 1}} if vision else {}),
            "enable_prefix_caching": True,
            "enable_chunked_prefill": True,
            "async_scheduling": False,
            # The vision model's weights are files of its own (dummy weights do not serve it).
            "load_format": "auto" if vision else "dummy",
            "skip_tokenizer_init": False,  # the tiny model has a tokenizer and a chat template
            "extra_args": extra,
            "env": {"VLLM_CPU_KVCACHE_SPACE": str(KV_CACHE_GIB), "VLLM_ENFORCE_STRICT_TOOL_CALLING": "0"},
        },
        # The tiny model's engine steps take milliseconds, a loaded two-core host's a few seconds:
        # 30 s of nothing moving while requests wait is a wedge here (GB10's default is 180 s).
        "supervisor": {"ready_timeout_s": 900.0, "liveness_interval_s": 5.0, "liveness_timeout_s": 10.0,
                       "stall_s": 30.0, "stop_grace_s": 15.0, "worker_wait_timeout_s": 600.0},
        "nodes": [
            {"name": HEAD_NAME, "rank": 0, "role": "head", "address": HEAD_ADDR, "api_host": HEAD_ADDR,
             "api_port": ports.api, **node_common},
            *({"name": node_name(r), "rank": r, "role": "worker", "address": node_address(r), **node_common}
              for r in range(1, nodes)),
        ],
    }


def prepare(workdir: Path, ports: LocalPorts = LocalPorts(), compile: bool = False,
            nodes: int = DEFAULT_NODES, line: str | None = None, vision: bool = False) -> Path:
    """Write the tiny model (the vision one with `vision`) and the cluster file under `workdir`;
    return the cluster file."""
    workdir = workdir.resolve()
    data = cluster_dict(workdir, ports, compile, nodes, line, vision)  # refusals before anything is written
    (local_vision if vision else local_model).write(model_dir(workdir, vision))
    C.from_dict(data)  # the generated file must pass the same validation as a hand-written one
    path = workdir / "cluster.toml"
    what = "two-node appliance" if nodes == 2 else f"{nodes}-node appliance"
    what += ", serving the tiny vision model" if vision else ""
    state_io.write_atomic(path, f"{LOCAL_HEADER}: the local {what}.\n" + dumps(data), mode=None)
    return path


def found_cluster_file(config_path: Path | None, say: Callable[[str], None]) -> Path | None:
    """The cluster file `dspark status` reads: the one named (--config, $DSPARK_CONFIG), else
    /etc's (None: config.load's default), else the local appliance's in .dspark/local (`say`
    tells so). With none of them, LocalError says how to make either kind."""
    if config_path is not None or DEFAULT_CONFIG_PATH.exists():
        return config_path
    found = DEFAULT_DIR / "cluster.toml"
    if found.is_file():
        say(f"(no {DEFAULT_CONFIG_PATH}: reading the local appliance's {found})")
        return found
    raise LocalError(f"no cluster file: none at {DEFAULT_CONFIG_PATH} and none at {found}; on the GB10 nodes "
                     f"write one (dspark config init {DEFAULT_CONFIG_PATH}), or start the local appliance "
                     f"({cli_command()} local up)")


def check_ports_free(ports: LocalPorts, nodes: int = DEFAULT_NODES) -> None:
    wanted = [(HEAD_ADDR, ports.api, "API"), (HEAD_ADDR, ports.master, "rendezvous"),
              (HEAD_ADDR, ports.agent, "head agent")]
    wanted += [(node_address(r), ports.agent, f"{node_name(r)} agent") for r in range(1, nodes)]
    for host, port, what in wanted:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError as e:
                raise LocalError(f"{what} port {host}:{port} is not free ({e.strerror}); "
                                 f"is another local appliance running? choose other ports (--api-port, --agent-port, "
                                 f"--master-port)") from None


def lock_path(workdir: Path) -> Path:
    return workdir.resolve() / LOCK_NAME


def _pid_in(fd: int) -> int | None:
    """The PID written in an open lock file, or None (empty: released cleanly, or not yet written)."""
    try:
        text = os.pread(fd, 64, 0).decode("ascii", "replace").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() and int(text) > 0 else None


@dataclass
class DirLock:
    """The directory held by this process (`local up`) until release()."""

    path: Path
    fd: int

    def release(self) -> None:
        """Empty the file (a clean stop leaves no PID for the next `local up` to call stale), then
        let the lock go. The file stays: removing it would let two processes lock two files."""
        if self.fd < 0:
            return
        try:
            os.ftruncate(self.fd, 0)
        except OSError:
            pass
        os.close(self.fd)
        self.fd = -1


def take_dir(workdir: Path, progress: Progress = print) -> DirLock:
    """Hold `workdir` for this process's appliance, before anything in it is written: refused,
    naming the PID, while another appliance holds it; a lock left by one that died (the kernel
    released its flock, its PID is still written) is taken over, and `progress` says so."""
    path = lock_path(workdir)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as e:
        raise LocalError(f"cannot lock {path}: {e.strerror}") from None
    deadline = time.monotonic() + LOCK_RETRY_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() < deadline:
                time.sleep(0.1)
                continue
            pid = _pid_in(fd)
            os.close(fd)
            who = f"PID {pid}" if pid else "a PID not written yet: it is starting"
            raise LocalError(f"{workdir} is in use: another local appliance ({who}) runs from it and holds {path}; "
                             f"stop it first ({cli_command()} local down --dir {workdir}) or give another --dir"
                             ) from None
        except OSError as e:
            os.close(fd)
            raise LocalError(f"cannot lock {path}: {e.strerror}") from None
    old = _pid_in(fd)
    behind = left_behind(workdir)
    if behind:  # its `local up` was killed outright: its supervisors (own sessions) still serve from here
        os.close(fd)  # its PID stays written
        raise LocalError(f"{workdir} is in use: the supervisors {', '.join(map(str, behind))} still run from it, left "
                         f"behind by the appliance that held it{f' (PID {old})' if old else ''}; stop them first "
                         f"({cli_command()} local down --dir {workdir})")
    if old is not None and old != os.getpid():
        progress(f"taking over {path}: the appliance that held it (PID {old}) ended without releasing it")
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return DirLock(path, fd)


@dataclass(frozen=True)
class Holder:
    """Who holds a directory's lock: `pid` (None: not written yet) while `running`; else the PID a
    dead appliance left written (`stale`), if any."""

    running: bool
    pid: int | None = None
    stale: int | None = None


def holder(workdir: Path) -> Holder:
    """Whether a local appliance runs from `workdir` (its lock is held), and its PID."""
    try:
        fd = os.open(lock_path(workdir), os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return Holder(False)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = _pid_in(fd)
            deadline = time.monotonic() + 2.0  # between its flock and its write: an instant
            while pid is None and time.monotonic() < deadline:
                time.sleep(0.1)
                pid = _pid_in(fd)
            return Holder(True, pid)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return Holder(False, stale=_pid_in(fd))
    finally:
        os.close(fd)


def left_behind(workdir: Path) -> list[int]:
    """The PIDs of `dspark serve` supervisors running from `workdir`'s cluster file (what `local
    up` starts, each in a session of its own, so they outlive a `local up` killed outright)."""
    target = str(workdir.resolve() / "cluster.toml").encode()
    out = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read(1 << 16).split(b"\0")
        except OSError:
            continue
        if b"serve" in argv and target in argv and any(b"dspark" in a for a in argv):
            out.append(int(entry))
    return sorted(out)


def planned_stop_s(sup: SupervisorConfig) -> float:
    """The longest a planned stop takes, kept by Pair.stop: the head's drain (drain_s), vLLM's
    time to exit after it (stop_grace_s; then the head kills it), and STOP_MARGIN_S for the
    supervisors' own exit, the workers stopping once their head shows STOPPED."""
    return sup.drain_s + sup.stop_grace_s + STOP_MARGIN_S


def stop_bound_s(workdir: Path) -> float:
    """The longest a planned stop of the appliance in `workdir` takes (planned_stop_s), from its
    cluster file (the defaults' when unreadable), and 5 s for `local up` to release its lock."""
    try:
        sup = C.load(workdir / "cluster.toml").supervisor
    except ConfigError:
        sup = SupervisorConfig()
    return planned_stop_s(sup) + 5


def _is_dspark(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"dspark" in f.read(1 << 16)
    except OSError:
        return False


def down(workdir: Path, timeout_s: float | None = None, progress: Progress = print) -> float:
    """Stop the appliance running from `workdir`: SIGTERM to the PID in its lock (the Ctrl-C of
    `local up`: the head first, then every node), then wait up to `timeout_s` (default: its
    stop's bound) for the lock to be released. Returns the seconds it took; LocalError when
    nothing runs there or it outlasts the wait."""
    h = holder(workdir)
    path = lock_path(workdir)
    if not h.running:
        last = f"; the last one there (PID {h.stale}) ended without a clean stop" if h.stale else ""
        behind = left_behind(workdir)
        if not behind:
            raise LocalError(f"nothing runs from {workdir}: no local appliance holds {path}{last}")
        return _stop_left_behind(workdir, behind, timeout_s, progress, last)
    if h.pid is None:
        raise LocalError(f"{path} is held, but no PID is written in it; nothing signalled")
    if not _is_dspark(h.pid):
        raise LocalError(f"{path} is held, and names PID {h.pid}, which is not a dspark process; nothing signalled")
    bound = stop_bound_s(workdir) if timeout_s is None else timeout_s
    t0 = time.monotonic()
    try:
        os.kill(h.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass  # it ended meanwhile: its lock says when it is gone
    progress(f"stopping the local appliance in {workdir} (PID {h.pid}): SIGTERM sent, as Ctrl-C would; "
             f"waiting up to {bound:g} s (the head drains first, then every node stops)")
    took = _wait_stopped(lambda: not holder(workdir).running, t0, bound)
    if took is not None:
        progress(f"stopped after {took:.1f} s; its logs are in {workdir.resolve() / 'logs'}")
        return took
    raise LocalError(f"the local appliance (PID {h.pid}) still runs {bound:g} s after SIGTERM: its nodes are still "
                     f"stopping (see {workdir.resolve() / 'logs'}); run local down again to wait longer")


def _wait_stopped(stopped: Callable[[], bool], t0: float, bound: float) -> float | None:
    """Seconds from `t0` until `stopped()` holds (polled every 0.2 s); None once `bound` passed."""
    while time.monotonic() - t0 < bound:
        if stopped():
            return time.monotonic() - t0
        time.sleep(0.2)
    return None


def _stop_left_behind(workdir: Path, pids: list[int], timeout_s: float | None, progress: Progress,
                      last: str) -> float:
    """SIGTERM every supervisor a killed `local up` left running from `workdir` (each stops its
    vLLM, a head after its drain), and wait for every one to end."""
    bound = stop_bound_s(workdir) if timeout_s is None else timeout_s
    t0 = time.monotonic()
    progress(f"no local appliance holds {lock_path(workdir)}{last}, but its supervisors {', '.join(map(str, pids))} "
             f"still run from {workdir}: SIGTERM sent to each; waiting up to {bound:g} s")
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    took = _wait_stopped(lambda: not left_behind(workdir), t0, bound)
    if took is not None:
        progress(f"stopped after {took:.1f} s; their logs are in {workdir.resolve() / 'logs'}")
        return took
    raise LocalError(f"supervisors {', '.join(map(str, left_behind(workdir)))} still run from {workdir} {bound:g} s "
                     "after SIGTERM; run local down again to wait longer")


@dataclass
class Pair:
    """The supervisors of a running local appliance, by node name (the head's first)."""

    cluster_file: Path
    workdir: Path
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    seen: dict[str, str] = field(default_factory=dict)  # the last state shown of each node

    def spawn(self, node: str) -> subprocess.Popen:
        logs = self.workdir / "logs"
        logs.mkdir(exist_ok=True)
        log = logs / f"{node}.log"
        if node not in self.procs and log.exists():
            log.replace(logs / f"{node}.log.1")  # each run starts a fresh log; the last run's is kept
        out = open(log, "ab")
        cmd = [sys.executable, "-m", "dspark", "serve", "--config", str(self.cluster_file), "--node", node,
               "--state-dir", str(self.workdir / "state" / node)]
        env = {k: v for k, v in os.environ.items() if k not in NOTIFY_ENV}
        # Own session: a Ctrl-C in the terminal reaches `local up`, which stops the pair in order.
        p = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             start_new_session=True, env=env)
        out.close()
        self.procs[node] = p
        return p

    def stop(self, bound_s: float = STOP_GRACE_S, *, planned: bool = False,
             again: Callable[[], bool] = lambda: False) -> str:
        """Stop every supervisor within `bound_s`. Planned: SIGTERM to the head alone, which drains
        the requests in flight (they need the workers' ranks) and stops; its workers stop on their
        own once it shows STOPPED. Otherwise (after a fault) SIGTERM to every one at once. Those
        still running STOP_MARGIN_S / 2 before the bound get SIGTERM, those still running at the
        bound SIGKILL. `again()` true (a second Ctrl-C): SIGKILL at once. Returns what it had to
        do beyond the plan ("" for nothing)."""
        deadline = time.monotonic() + bound_s
        head = self.procs.get(HEAD_NAME)
        if planned and head is not None and head.poll() is None:
            head.send_signal(signal.SIGTERM)
            done = self._wait_all(deadline - STOP_MARGIN_S / 2, again)
        else:
            done = False
        forced = ""
        if not done and not again():
            for p in self.procs.values():
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
            done = self._wait_all(deadline, again)
        if again():
            forced = "a second signal: every node killed at once (SIGKILL)"
        elif not done:
            forced = f"still running {bound_s:g} s after the stop began: killed (SIGKILL)"
        for p in self.procs.values():
            # A supervisor sweeps vLLM's process group itself (its reaper does, should the
            # supervisor be killed); this sweeps the supervisor's own group, the last resort.
            end_group(p.pid, [p])
        return forced

    def _wait_all(self, until: float, again: Callable[[], bool]) -> bool:
        """Wait until every supervisor has exited (True), `until` passes or `again()` (False)."""
        while time.monotonic() < until and not again():
            if all(p.poll() is not None for p in self.procs.values()):
                return True
            time.sleep(0.1)
        return all(p.poll() is not None for p in self.procs.values())


Progress = Callable[[str], None]


def wait_state(pair: Pair, node: NodeConfig, states: tuple[str, ...], timeout_s: float,
               progress: Progress, should_stop: Callable[[], bool], t0: float | None = None,
               watch: tuple[NodeConfig, ...] = ()) -> None:
    """Wait until `node` is in one of `states`. Every state change of it and of the `watch`
    nodes is shown once, in the order seen, with the seconds since `t0` (local up's start)."""
    since = time.monotonic()
    t0 = since if t0 is None else t0
    while True:
        for n in (node, *watch):
            p = pair.procs[n.name]
            rc = p.poll()
            if rc is not None:
                raise LocalError(f"{n.name}'s supervisor exited with code {rc}; see "
                                 f"{pair.workdir / 'logs' / (n.name + '.log')}")
            s = agent_state(n.agent_url, timeout=1.0)
            cur = (s or {}).get("state", "starting")
            detail = (s or {}).get("detail") or f"supervisor started (pid {p.pid}); its agent is not answering yet"
            if pair.seen.get(n.name) != cur:
                progress(f"  {n.name:<13} {cur:<11} {detail}  [{time.monotonic() - t0:5.1f} s]")
                pair.seen[n.name] = cur
            if cur == A.FAILED:
                raise LocalError(f"{n.name} failed: {detail}")
        if pair.seen.get(node.name) in states:
            return
        if should_stop():
            raise KeyboardInterrupt
        if time.monotonic() - since > timeout_s:
            raise LocalError(f"{node.name} not {'/'.join(states)} after {timeout_s:g} s")
        time.sleep(0.5)


def preflight(cluster: Cluster, node: NodeConfig, progress: Progress, host: Host | None = None) -> None:
    """`dspark check` for `node` before it starts: warnings and failures shown, a failure stops."""
    import dataclasses

    from dspark.preflight import Host, run

    report = run(cluster, node, dataclasses.replace(host or Host(), starting=True))
    for c in report.checks:
        if c.status != "ok":
            progress(f"  {node.name:<13} check {c.status}: {c.name}: {c.seen}")
    if report.failed:
        raise LocalError("dspark check failed for " + node.name + ": "
                         + "; ".join(f"{c.name}: {c.seen} (fix: {c.fix})" for c in report.failed))
    progress(f"  {report.summary()}")


def up(workdir: Path, ports: LocalPorts = LocalPorts(), progress: Progress = print,
       compile: bool = False, on_ready: Callable[[Pair], None] | None = None, check_host: Host | None = None,
       nodes: int = DEFAULT_NODES, line: str | None = None, vision: bool = False) -> int:
    """Bring the appliance up, report, and supervise until Ctrl-C / SIGTERM; always stop every
    node. Each node is checked (`dspark check`) right before it starts; `check_host`: where the
    checks look (dspark.preflight.Host; default this machine). `line`: the runtime line every
    node runs (default: the default line, this environment's vLLM). `vision`: serve the tiny
    vision model (dspark.local.vision) in place of the text one."""
    check_nodes(nodes)  # before the ports: a count the model cannot take is the first thing to say
    vllm_command(line)  # a line that is not installed: said before the ports are looked at
    if vision:
        check_vision(line, nodes)
    # The directory before the ports: another appliance there is named by its PID, and nothing
    # in the directory is touched (cluster file, logs, state) while another appliance holds it.
    lock = take_dir(workdir, progress)
    try:
        return _up(workdir, ports, progress, compile, on_ready, check_host, nodes, line, vision)
    finally:
        lock.release()


def _up(workdir: Path, ports: LocalPorts, progress: Progress, compile: bool,
        on_ready: Callable[[Pair], None] | None, check_host: Host | None, nodes: int, line: str | None,
        vision: bool) -> int:
    """up()'s body, with `workdir` held (`lock`)."""
    check_ports_free(ports, nodes)
    cluster_file = prepare(workdir, ports, compile, nodes, line, vision)
    cluster = C.load(cluster_file)
    head, workers = cluster.head, cluster.workers
    pair = Pair(cluster_file, workdir.resolve())
    # A fresh appliance: no restart count or failure history carried over from earlier runs.
    for node in cluster.nodes:
        for name in ("starts", "failures.json", line_state.FILE):
            (pair.workdir / "state" / node.name / name).unlink(missing_ok=True)
    sigs = SignalQueue().install((signal.SIGINT, signal.SIGTERM))

    def stopping() -> bool:
        return sigs.first is not None

    everyone = "both nodes" if nodes == 2 else f"all {nodes} nodes"
    sup = cluster.supervisor
    bound = planned_stop_s(sup)
    drain = (f"the head first: its requests in flight have up to {sup.drain_s:g} s, vLLM {sup.stop_grace_s:g} s "
             f"more to exit; done within {bound:g} s; Ctrl-C again kills every node at once"
             if sup.drain_s > 0 else f"the head first; done within {bound:g} s; Ctrl-C again kills every node at once")
    planned = False
    t0 = time.monotonic()
    try:
        progress(f"dspark local: cluster {cluster_file}; [times] are seconds since local up started")
        progress(f"runtime line {cluster.serving.runtime_line}: {' '.join(cluster.serving.vllm_command)}")
        for w in workers:
            progress(f"checking {w.name} (rank {w.rank}, {w.address})")
            preflight(cluster, w, progress, check_host)
            progress(f"starting {w.name} (rank {w.rank}, {w.address}); logs in {pair.workdir / 'logs'}")
            pair.spawn(w.name)
        for w in workers:
            others = tuple(o for o in workers if o is not w)
            wait_state(pair, w, (A.RENDEZVOUS, A.SERVING), 600, progress, stopping, t0, watch=others)
        # The head is checked once the workers run: its check compares the nodes' cluster
        # file, model, runtime and clocks through the workers' agents.
        preflight(cluster, head, progress, check_host)
        progress(f"starting the head (rank 0, {head.address})")
        pair.spawn(head.name)
        wait_state(pair, head, (A.SERVING,), cluster.supervisor.ready_timeout_s, progress, stopping, t0,
                   watch=tuple(workers))
        # The workers follow their head into serving within a poll (about a second).
        for w in workers:
            wait_state(pair, w, (A.SERVING,), 30, progress, stopping, t0,
                       watch=(head, *(o for o in workers if o is not w)))
        elapsed = time.monotonic() - t0
        progress("")
        progress(f"serving after {elapsed:.0f} s: {head.api_url}/v1  (model {SERVED_NAME!r}; random weights, "
                 "so its text is gibberish)")
        progress(f"  curl -s {head.api_url}/v1/chat/completions -H 'Content-Type: application/json' \\")
        progress(f"    -d '{{\"model\": \"{SERVED_NAME}\", \"messages\": [{{\"role\": \"user\", \"content\": "
                 f"\"Hello\"}}], \"max_tokens\": 16}}'")
        progress("  (text, chat and token-id prompts all work: the tiny model has a tokenizer and a chat template; "
                 "docs/quick-start.md has the same request with the OpenAI SDK)")
        if vision:
            progress(f"  (vision: a user message may carry one image, an image_url part with a data URL; "
                     f"it takes {local_vision.IMAGE_TOKENS} prompt tokens, whatever its size)")
        progress(f"  {cli_command()} status --config {cluster_file}")
        progress(f"Ctrl-C stops {everyone}.")
        if on_ready:
            on_ready(pair)
        while sigs.first is None:
            for name, p in pair.procs.items():
                if p.poll() is not None:
                    raise LocalError(f"{name}'s supervisor exited with code {p.returncode}; see "
                                     f"{pair.workdir / 'logs' / (name + '.log')}")
            sigs.get(0.5)
        progress(f"stopping {everyone} ({drain}) ...")
        planned = True
        return 0
    except KeyboardInterrupt:
        progress(f"stopping {everyone} ({drain}) ...")
        planned = True
        return 130
    finally:
        # A planned stop: the head first, which drains (drain_s), then vLLM has stop_grace_s and
        # its sweep; the workers stop once it shows STOPPED. After a fault (a supervisor exited:
        # the pair is broken) every node at once. A second Ctrl-C kills them all at once.
        t_stop = time.monotonic()
        forced = pair.stop(bound if planned else STOP_GRACE_S, planned=planned, again=lambda: sigs.received >= 2)
        sigs.restore()
        if forced:
            progress(forced)
        progress(f"stopped; no process left behind (the stop took {time.monotonic() - t_stop:.1f} s)"
                 if all(p.poll() is not None for p in pair.procs.values()) else "warning: a supervisor did not exit")
