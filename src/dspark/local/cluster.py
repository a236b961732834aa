"""The local appliance's cluster file: its nodes (head on 127.0.0.1, rank r on 127.0.0.(r+1),
tensor parallel over all of them), names and ports, the runtime lines installed here, and the
file `local up` writes with its tiny model (`prepare`); the one `dspark status` finds
(`found_cluster_file`). LocalError is what every part of the appliance raises.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dspark.config import validate as C
from dspark.config.schema import DEFAULT_CONFIG_PATH, GIB
from dspark.config.template import dumps
from dspark.files import state_io
from dspark.local import model as local_model
from dspark.local import vision as local_vision
from dspark.local.model import TINY_MODEL
from dspark.status import LOCAL_HEADER, cli_command

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



Progress = Callable[[str], None]  # how `local up` / `local down` report, a line at a time


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
