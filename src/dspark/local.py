"""The local appliance: the GB10 pair (or ring of N nodes) on one machine, with the real vLLM
CPU build.

A generated cluster file (head on 127.0.0.1, rank r on 127.0.0.(r+1), tensor parallel over all
of them) and a tiny random-weight model, run through the very same `dspark serve` supervisors
as on the GB10 nodes: the workers first, then the head once every worker's agent reports the
rendezvous.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from . import states as A
from . import config as C
from . import line_state
from .notify import NOTIFY_ENV
from .signals import SignalQueue
from .vllm_process import end_group
from .agent_client import agent_state
from . import local_model, local_vision
from .local_model import TINY_MODEL

WORKER_ADDR = "127.0.0.2"
HEAD_ADDR = "127.0.0.1"
HEAD_NAME = "local-head"
WORKER_NAME = "local-worker"  # rank 1; ranks 2.. are local-worker-2, local-worker-3, ...
SERVED_NAME = "dspark-local"
DEFAULT_NODES = 2
DEFAULT_DIR = Path(".dspark/local")  # `local up --dir`, `local switch --dir`
MAX_NODES = 8

KV_CACHE_GIB = 1  # per rank; the CPU build takes it from VLLM_CPU_KVCACHE_SPACE


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
    from . import runtime_lines

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
    from . import runtime_lines

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
    from . import runtime_lines

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
            "kv_cache_memory_bytes": KV_CACHE_GIB * C.GIB,
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
    path.write_text(f"# Generated by `dspark local up`: the local {what}.\n" + C.dumps(data))
    return path


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

    def stop(self, grace_s: float = 40.0, head_s: float = 0.0) -> None:
        """SIGTERM the head's supervisor and wait up to `head_s` for it (it drains the requests
        in flight, which need the workers' ranks); then SIGTERM every supervisor still running
        (a second SIGTERM ends a head's drain at once) and wait up to `grace_s` for every one;
        SIGKILL their groups if they overstay."""
        head = self.procs.get(HEAD_NAME)
        if head is not None and head.poll() is None:
            head.send_signal(signal.SIGTERM)
            try:
                head.wait(timeout=max(0.1, head_s))
            except subprocess.TimeoutExpired:
                pass
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for p in self.procs.values():
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for p in self.procs.values():
            # A supervisor sweeps vLLM's process group itself (its reaper does, should the
            # supervisor be killed); this sweeps the supervisor's own group, the last resort.
            end_group(p.pid, [p])


Progress = Callable[[str], None]


def wait_state(pair: Pair, node: C.NodeConfig, states: tuple[str, ...], timeout_s: float,
               progress: Progress, should_stop: Callable[[], bool], t0: float | None = None,
               watch: tuple[C.NodeConfig, ...] = ()) -> None:
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


def cli_command() -> str:
    """How to run dspark from this shell: `dspark` when that is on PATH and is this very
    install, else the path of this install's script (e.g. .venv/bin/dspark)."""
    import shutil

    mine = Path(sys.executable).parent / "dspark"
    found = shutil.which("dspark")
    if found and mine.exists() and Path(found).resolve() == mine.resolve():
        return "dspark"
    if not mine.exists():
        return f"{sys.executable} -m dspark"
    try:
        return str(mine.relative_to(Path.cwd()))
    except ValueError:
        return str(mine)


def preflight(cluster: C.Cluster, node: C.NodeConfig, progress: Progress, host=None) -> None:
    """`dspark check` for `node` before it starts: warnings and failures shown, a failure stops."""
    import dataclasses

    from .preflight import Host, run

    report = run(cluster, node, dataclasses.replace(host or Host(), starting=True))
    for c in report.checks:
        if c.status != "ok":
            progress(f"  {node.name:<13} check {c.status}: {c.name}: {c.seen}")
    if report.failed:
        raise LocalError("dspark check failed for " + node.name + ": "
                         + "; ".join(f"{c.name}: {c.seen} (fix: {c.fix})" for c in report.failed))
    progress(f"  {report.summary()}")


def up(workdir: Path, ports: LocalPorts = LocalPorts(), progress: Progress = print,
       compile: bool = False, on_ready: Callable[[Pair], None] | None = None, check_host=None,
       nodes: int = DEFAULT_NODES, line: str | None = None, vision: bool = False) -> int:
    """Bring the appliance up, report, and supervise until Ctrl-C / SIGTERM; always stop every
    node. Each node is checked (`dspark check`) right before it starts; `check_host`: where the
    checks look (dspark.preflight.Host; default this machine). `line`: the runtime line every
    node runs (default: the default line, this environment's vLLM). `vision`: serve the tiny
    vision model (dspark.local_vision) in place of the text one."""
    check_nodes(nodes)  # before the ports: a count the model cannot take is the first thing to say
    vllm_command(line)  # a line that is not installed: said before the ports are looked at
    if vision:
        check_vision(line, nodes)
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
    drain = (f"the head first: its requests in flight finish within {cluster.supervisor.drain_s:g} s"
             if cluster.supervisor.drain_s > 0 else "the head first")
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
        # its sweep. After a fault (a supervisor exited: the pair is broken) every node at once:
        # Pair.stop's second SIGTERM to a head still draining stops it at once.
        sup = cluster.supervisor
        pair.stop(head_s=sup.drain_s + sup.stop_grace_s + 30 if planned else 0.0)
        sigs.restore()
        progress("stopped; no process left behind" if all(p.poll() is not None for p in pair.procs.values())
                 else "warning: a supervisor did not exit")
