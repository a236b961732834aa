"""The cluster file: one TOML description of a deployment, validated once at the edge.

Both nodes read the same file. Every field is declared once below, with its help text
and an example; the validator, the error messages and the commented template
(`dspark config init`) are all derived from these declarations.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import ipaddress
import math
import os
import re
import socket
import textwrap
import tomllib
import types
import typing
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEFAULT_CONFIG_PATH = Path("/etc/dspark/cluster.toml")
PLACEHOLDER = "CHANGEME"
GIB = 1024**3
# The file itself: a regular file of at most this size, UTF-8, nested at most this deep.
MAX_FILE_BYTES = 1024 * 1024
MAX_DEPTH = 8
# Environment names: what a POSIX shell can assign and systemd's Environment= accepts.
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
DAY_S = 86400.0
# The shortest interval or timeout the supervisor takes: below it a loop spins (1e-300 s ran a
# core flat out) and no HTTP answer or process exit can be waited for.
MIN_SECONDS = 0.1
# The longest single argument dspark puts on vLLM's command line (a path is at most 4096 bytes).
MAX_ARG_CHARS = 4096
# What a host name may be (RFC 1123 labels, 253 characters at most).
_HOST_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")


class ConfigError(Exception):
    """A cluster file that cannot be used; `problems` holds one line per fault."""

    def __init__(self, problems: list[str], source: str | None = None):
        self.problems = problems
        self.source = source
        where = f"{source}: " if source else ""
        super().__init__(where + "; ".join(problems))

    def render(self) -> str:
        head = f"{self.source} is not a valid cluster file:" if self.source else "invalid cluster file:"
        return "\n".join([head] + [f"  - {p}" for p in self.problems])


def _f(default: Any = dataclasses.MISSING, *, help: str, example: Any = None, factory: Any = None,
       bounds: tuple[float, float] | None = None, positive: bool = False, source: str | None = None):
    """Declare a config field: its default, help text, an example for error messages and, for a
    number, its range: `bounds` (lo, hi), both included, or `positive` for (0, hi]. Every number
    must also be finite: the ranges are the one policy, checked in `check_ranges`. `source` says
    where a serving default comes from (a public measurement on GB10, or vLLM's code); the
    template prints it under the help text."""
    meta = {"help": help, "example": example, "bounds": bounds, "positive": positive, "source": source}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


# The seed's tested serving settings for DeepSeek V4 Flash on two GB10 nodes
# (shared/reference/deepseek-v4-flash.md, "The seed's serving command line").
SEED_SPECULATIVE = {"method": "dspark", "num_speculative_tokens": 5, "draft_sample_method": "probabilistic"}
SEED_EXTRA_ARGS = [
    "--tokenizer-mode", "deepseek_v4",
    "--tool-call-parser", "deepseek_v4",
    "--enable-auto-tool-choice",
    "--reasoning-parser", "deepseek_v4",
    "--generation-config", "vllm",
]
# The seed's environment on both ranks, plus the settings below, each with its source.
SEED_ENV = {
    "NCCL_NET": "IB",
    "NCCL_IB_ADDR_FAMILY": "AF_INET",
    "NCCL_IB_ROCE_VERSION_NUM": "2",
    "NCCL_CROSS_NIC": "1",
    "NCCL_CUMEM_ENABLE": "0",
    "NCCL_NVLS_ENABLE": "0",
    "VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1",
    "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
    "TORCH_CUDA_ARCH_LIST": "12.1a",
    # vLLM 0.28.0 (config/vllm.py, VllmConfig.__post_init__) turns breakable CUDA graphs on for
    # DeepseekV4ForCausalLM whenever this is unset; 0 keeps regular (FULL decode) graphs. The
    # fastest public two-GB10 recipe (MiaAI-Lab) sets 0: +28.6% single stream, +13% at c=2.
    "VLLM_USE_BREAKABLE_CUDAGRAPH": "0",
}

# What the template leaves unset on purpose, and why (printed in it).
NOT_SET = [
    "vLLM's shm_broadcast reader busy-loop (SpinCondition.busy_loop_s = 1 s): measured at 333% CPU "
    "and the SoC 11 C hotter on a TP=2 GB10 pair, 89% once cut to 2 ms with no throughput change "
    "(MiaAI-Lab PR #71; vLLM PR #51950 proposed VLLM_MQ_SPIN_SECONDS and was closed). vLLM 0.28.0 "
    "has no setting for it (the reader's SpinCondition is built with the 1 s default in "
    "distributed/device_communicators/shm_broadcast.py); only a code change (the overlay) can.",
]


@dataclass(frozen=True)
class ModelConfig:
    path: str = _f(help="Model directory on every node (config.json and safetensors shards).",
                   example="/var/lib/dspark/models/DeepSeek-V4-Flash")
    served_name: str = _f("deepseek-v4-flash", help="Model name clients use in API requests.",
                          example="deepseek-v4-flash")
    trust_remote_code: bool = _f(True, help="Pass --trust-remote-code to vLLM.", example=True)


# Where the serving defaults come from (printed in the template). "seed 001": the two-node GB10
# port of Anemll/dspark-vllm-gx10 (vLLM 0.25.1), whose tested command line these defaults started
# from; "MiaAI-Lab": the fastest public two-GB10 recipe (MiaAI-Lab/DeepSeek-v4-Flash-DSpark-2x-
# DGX-Spark, 75.4 tok/s single stream, 191.2 at c=6), which runs the seed-001 image.
_SEED = "seed 001's tested two-GB10 command line (Anemll/dspark-vllm-gx10)"
_BOTH = _SEED + " and MiaAI-Lab's two-GB10 recipe"


@dataclass(frozen=True)
class ServingConfig:
    vllm_command: list[str] = _f(help="Command that runs vLLM's CLI on every node (argv prefix before 'serve').",
                                 example=["vllm"], factory=lambda: ["vllm"],
                                 source="vLLM's own CLI entry point (`vllm serve`)")
    runtime_line: str = _f("v0.28.0", help="Runtime line: the vLLM release (and overlay) the nodes run; the "
                                            "settings below are rendered to its flags, or refused.",
                           example="v0.28.0",
                           source="dspark's runtime lines (dspark/data/runtime_lines.toml); v0.28.0 is the "
                                  "seed line, vLLM 0.28.0 with the whole overlay")
    line_commands: dict[str, list[str]] = _f(
        help="vLLM's command of each runtime line installed on the nodes, by line: what `dspark switch` can "
             "move the pair to. A node runs line_commands[its line], else vllm_command.",
        example={"v0.29.0": ["/opt/dspark/lines/v0.29.0/bin/vllm"]}, factory=dict,
        source="dspark's runtime lines; the NixOS module writes one entry per line it builds "
               "(services.dspark.lines), `dspark local up` one per line installed here")
    tensor_parallel_size: int = _f(2, help="Tensor parallel size: nodes x GPUs per node.", example=2,
                                   bounds=(1, 1024),
                                   source=_BOTH + " (TP=2; TP=1 does not load on one node: NV_ERR_NO_MEMORY)")
    pipeline_parallel_size: int = _f(1, help="Pipeline parallel size.", example=1, bounds=(1, 1024),
                                     source=_BOTH)
    gpus_per_node: int = _f(1, help="GPUs on each node (one GB10 per DGX Spark).", example=1, bounds=(1, 64),
                            source="the hardware: one GB10 per DGX Spark")
    usable_memory_gib: float = _f(121.0, help="Usable GPU (unified) memory of one GPU, GiB; the plan's budget.",
                                  example=121.0, bounds=(0, 16384), positive=True,
                                  source="seed 001's measurement of one GB10 node (about 121 GiB usable)")
    max_model_len: int = _f(350000, help="Longest context (prompt + output) in tokens.", example=350000,
                            bounds=(1, 1 << 24),
                            source=_SEED + " (MiaAI-Lab runs 1,048,576 with 6 sequences)")
    max_num_seqs: int = _f(12, help="Requests decoded at once.", example=12, bounds=(1, 65536),
                           source=_SEED + ": 103.5 tok/s aggregate at c=4 (MiaAI-Lab runs 6)")
    max_num_batched_tokens: int = _f(8192, help="Tokens per scheduler step (chunked prefill).", example=8192,
                                     bounds=(1, 1 << 24), source=_BOTH)
    gpu_memory_utilization: float | None = _f(
        0.835, help="Share of each GPU's memory vLLM may use (0 < x <= 1).", example=0.835, bounds=(0, 1),
        positive=True,
        source="MiaAI-Lab's two-GB10 recipe runs 0.835 on the same nodes (seed 001 measured 0.78: 79.17 GiB "
               "model and 10.74 GiB KV cache per rank); `dspark plan --published` at these settings: "
               "101.03 GiB per rank, 17.39 GiB of it KV cache")
    kv_cache_memory_bytes: int | None = _f(
        None, help="KV-cache bytes per GPU; when set, vLLM uses it instead of gpu_memory_utilization.",
        example=12 * GIB, bounds=(1, 1 << 50), source="vLLM's default (unset)")
    kv_cache_dtype: str | None = _f("nvfp4_ds_mla", help="KV-cache dtype (nvfp4_ds_mla needs the Spark overlay).",
                                    example="nvfp4_ds_mla", source=_BOTH)
    block_size: int | None = _f(256, help="KV-cache block size in tokens.", example=256, bounds=(1, 65536),
                                source=_SEED + "; vLLM 0.28.0's SM120 DeepSeek V4 attention takes kernel "
                                       "blocks of 256 only (get_supported_kernel_block_sizes)")
    speculative_config: dict | None = _f(
        help="vLLM --speculative-config as a table; omit for none.",
        example=SEED_SPECULATIVE, factory=lambda: dict(SEED_SPECULATIVE),
        source=_BOTH + " (DSpark, k=5)")
    enable_prefix_caching: bool = _f(True, help="Reuse KV of shared prompt prefixes.", example=True, source=_SEED)
    enable_chunked_prefill: bool = _f(True, help="Split long prompts into scheduler-sized chunks.", example=True,
                                      source=_SEED)
    async_scheduling: bool = _f(True, help="Overlap scheduling with execution.", example=True, source=_SEED)
    moe_backend: str | None = _f("flashinfer_b12x", help="MoE experts backend (flashinfer_b12x needs the overlay).",
                                 example="flashinfer_b12x", source=_BOTH)
    long_prefill_token_threshold: int | None = _f(
        1024, help="Longest prefill chunk one request gets per scheduler step (vLLM "
                   "--long-prefill-token-threshold; 0 = up to max_num_batched_tokens).",
        example=1024, bounds=(0, 1 << 24),
        source="MiaAI-Lab's two-GB10 recipe (1024). At ~2,000-2,600 prefill tok/s on two GB10 (seed 001, "
               "MiaAI-Lab) a full 8,192-token chunk holds every decoding stream for ~3.5-4 s; vLLM 0.28.0's "
               "scheduler caps each request's new tokens per step at this (v1/core/sched/scheduler.py)")
    max_cudagraph_capture_size: int | None = _f(
        None, help="Largest CUDA-graph capture size; default max_num_seqs x (speculative tokens + 1).", example=72,
        bounds=(1, 1 << 20), source="seed 001 (72 = 12 x 6)")
    cudagraph_capture_sizes: list[int] | None = _f(
        None, help="CUDA-graph capture sizes (vLLM --cudagraph-capture-sizes); default with speculative "
                   "decoding: every multiple of (speculative tokens + 1) up to the largest capture size "
                   "(6, 12, ..., 72), without: vLLM's own list.",
        example=[6, 12, 18, 24, 30, 36], bounds=(1, 1 << 20),
        source="vLLM 0.28.0's model runner v2 (which DSpark forces) replays a FULL decode graph for n "
               "requests only at a capture size that is a multiple of n's rows (v1/worker/gpu/"
               "cudagraph_utils.py): with its default sizes 1, 2, 4, 8, ..., 72, batches of 5 and 9 "
               "requests fall to PIECEWISE (tests/test_config_sources.py)")
    load_format: str | None = _f(None, help="vLLM --load-format ('dummy' gives random weights).", example="auto",
                                 source="vLLM's default (auto)")
    skip_tokenizer_init: bool = _f(False, help="Serve token-id prompts only, without a tokenizer.", example=False,
                                   source="vLLM's default")
    extra_args: list[str] = _f(help="More vLLM arguments, appended as written.", example=["--enforce-eager"],
                               factory=lambda: list(SEED_EXTRA_ARGS), source=_SEED)
    env: dict[str, str] = _f(help="Environment for vLLM on every node.", example={"NCCL_DEBUG": "WARN"},
                             factory=lambda: dict(SEED_ENV),
                             source=_SEED + "'s environment, plus VLLM_USE_BREAKABLE_CUDAGRAPH=0: vLLM 0.28.0 "
                                    "turns breakable CUDA graphs on for DeepSeek V4 when it is unset "
                                    "(config/vllm.py); MiaAI-Lab measured +28.6% single stream and +13% at "
                                    "c=2 (75 -> 96 tok/s) with it at 0")

    @property
    def num_speculative_tokens(self) -> int:
        spec = self.speculative_config or {}
        return int(spec.get("num_speculative_tokens", 0) or 0)

    @property
    def cudagraph_capture_size(self) -> int:
        if self.max_cudagraph_capture_size is not None:
            return self.max_cudagraph_capture_size
        if self.cudagraph_capture_sizes:
            return max(self.cudagraph_capture_sizes)
        return self.max_num_seqs * (self.num_speculative_tokens + 1)

    @property
    def capture_sizes(self) -> list[int] | None:
        """The sizes dspark passes as --cudagraph-capture-sizes, or None to leave vLLM's own list
        (no speculative decoding): with k speculative tokens every batch of n requests verifies
        n x (k + 1) rows, and vLLM's model runner v2 replays a FULL decode graph only at a size
        that is a multiple of k + 1, so every multiple up to the largest size is captured."""
        if self.cudagraph_capture_sizes is not None:
            return sorted(set(self.cudagraph_capture_sizes))
        step = self.num_speculative_tokens + 1
        if step == 1:
            return None
        return list(range(step, self.cudagraph_capture_size + 1, step)) or [self.cudagraph_capture_size]


@dataclass(frozen=True)
class SupervisorConfig:
    ready_timeout_s: float = _f(1800.0, help="Give up (exit 'never ready') if vLLM is not serving by then.",
                                example=1800.0, bounds=(MIN_SECONDS, DAY_S))
    liveness_interval_s: float = _f(5.0, help="Seconds between the head's liveness rounds: a /metrics reading (progress while requests run or wait), and a real 1-token completion only while the engine is idle.",
                                    example=5.0, bounds=(MIN_SECONDS, 3600.0))
    liveness_timeout_s: float = _f(10.0, help="A liveness completion slower than this counts as failed.",
                                   example=10.0, bounds=(MIN_SECONDS, 3600.0))
    liveness_failures: int = _f(2, help="Consecutive failed liveness checks before the head gives up.", example=2,
                                bounds=(1, 1000))
    stall_s: float = _f(
        180.0, help="While requests run or wait, the head's engine is alive as long as vLLM's token counters "
                    "or KV-cache usage move (no 1-token probe then: it would queue behind the load); nothing "
                    "moving for this long is a stall (a wedged collective) and stops the pair. Above the "
                    "slowest engine step (an 8192-token prefill chunk takes seconds on two GB10 nodes at "
                    "about 2,000 prompt tok/s) and below vLLM's own 300 s step timeout.",
        example=180.0, bounds=(MIN_SECONDS, DAY_S))
    stop_grace_s: float = _f(30.0, help="Seconds vLLM gets after SIGTERM before SIGKILL.", example=30.0,
                             bounds=(MIN_SECONDS, 3600.0))
    drain_s: float = _f(
        60.0, help="A planned stop of the serving head (SIGTERM or SIGINT: systemctl stop, Ctrl-C) lets the "
                   "requests in flight finish for up to this long, turning new ones away (vLLM's "
                   "--shutdown-timeout), then stops vLLM; 0 aborts them at once. A fault (vLLM died, a "
                   "peer lost, liveness lost) never drains.",
        example=60.0, bounds=(0, 3600.0))
    head_lost_s: float = _f(10.0, help="A serving worker leaves once the head's agent is unreachable this long.",
                            example=10.0, bounds=(MIN_SECONDS, DAY_S))
    rendezvous_timeout_s: float = _f(900.0, help="A worker leaves if the head has not come up by then.",
                                     example=900.0, bounds=(MIN_SECONDS, DAY_S))
    worker_wait_timeout_s: float = _f(900.0, help="How long 'dspark wait-worker' waits for the worker.",
                                      example=900.0, bounds=(MIN_SECONDS, DAY_S))


@dataclass(frozen=True)
class NodeConfig:
    name: str = _f(help="Node name; a process finds its entry by this (default: the host name).",
                   example="spark-a")
    rank: int = _f(help="Node rank: 0 is the head (serves the API), others are headless workers.", example=0,
                   bounds=(0, 1023))
    address: str = _f(help="This node's address on the dedicated fabric (VLLM_HOST_IP).", example="192.168.100.10")
    socket_ifname: str | None = _f(None, help="Fabric interface for NCCL/Gloo/TP sockets.", example="enp1s0f0np0")
    rdma_device: str | None = _f(None, help="RDMA device for NCCL_IB_HCA.", example="rocep1s0f0")
    gid_index: str | None = _f(
        None, help="NCCL_IB_GID_INDEX: a number, or 'auto' to resolve the RoCEv2 IPv4 GID from sysfs at launch.",
        example="auto")
    allow_default_route: bool = _f(
        False, help="Let socket_ifname be the interface of the default route (dspark check refuses it otherwise: "
                    "the fabric belongs on the dedicated link, not the management or internet one).", example=False)
    role: str | None = _f(None, help="Optional check: 'head' (rank 0) or 'worker'.", example="head")
    api_host: str | None = _f(
        None, help="Address the head's API binds (default: the fabric address, which only the nodes reach; "
                   "\"127.0.0.1\": this host only). \"0.0.0.0\" or \"::\" opens it to every network of the host: "
                   "set an API key then (dspark check warns without one).", example="127.0.0.1")
    api_port: int = _f(8888, help="Head's OpenAI-compatible API port.", example=8888)
    master_port: int = _f(25000, help="Rendezvous port (read from the head's entry).", example=25000)
    agent_host: str | None = _f(None, help="Address the node agent binds (default: the fabric address).",
                                example="192.168.100.10")
    agent_port: int = _f(8890, help="Port of this node's read-only agent (state, metrics).", example=8890)
    env: dict[str, str] = _f(help="Extra environment for vLLM on this node only.", example={},
                             factory=dict)

    @property
    def is_head(self) -> bool:
        return self.rank == 0

    @property
    def api_bind(self) -> str:
        return self.api_host or self.address

    @property
    def agent_bind(self) -> str:
        return self.agent_host or self.address

    @property
    def agent_url(self) -> str:
        return f"http://{_host_for_url(self.agent_bind)}:{self.agent_port}"

    @property
    def api_url(self) -> str:
        host = self.address if self.api_bind in ("0.0.0.0", "::") else self.api_bind
        return f"http://{_host_for_url(host)}:{self.api_port}"


def _host_for_url(host: str) -> str:
    return f"[{host}]" if ":" in host else host


@dataclass(frozen=True)
class Cluster:
    model: ModelConfig
    serving: ServingConfig = field(default_factory=ServingConfig)
    supervisor: SupervisorConfig = field(default_factory=SupervisorConfig)
    nodes: tuple[NodeConfig, ...] = ()
    source: str | None = None

    @property
    def head(self) -> NodeConfig:
        return next(n for n in self.nodes if n.rank == 0)

    @property
    def workers(self) -> list[NodeConfig]:
        return sorted((n for n in self.nodes if n.rank != 0), key=lambda n: n.rank)

    def on_line(self, line: str) -> "Cluster":
        """This cluster as a node runs it on runtime line `line`: the line's command from
        serving.line_commands (vllm_command for the file's own line when the table lacks it).
        Raises ConfigError for a line with no command here."""
        s = self.serving
        command = s.line_commands.get(line) or (s.vllm_command if line == s.runtime_line else None)
        if not command:
            installed = sorted({s.runtime_line, *s.line_commands})
            raise ConfigError([f"serving.line_commands: runtime line {line!r} is not installed on the nodes "
                               f"(installed: {', '.join(installed)}); add its vLLM command, e.g. "
                               f"line_commands = {{ {_toml_value(line)} = [\"/path/to/{line}/bin/vllm\"] }}"],
                              self.source)
        return dataclasses.replace(self, serving=dataclasses.replace(s, runtime_line=line, vllm_command=list(command)))

    def node(self, name: str | None = None) -> NodeConfig:
        """The entry for `name` (default: $DSPARK_NODE, then the host name)."""
        wanted = name or os.environ.get("DSPARK_NODE") or socket.gethostname()
        for n in self.nodes:
            if n.name == wanted:
                return n
        names = ", ".join(n.name for n in self.nodes)
        how = "" if name else " (taken from the host name; pass --node NAME)"
        raise ConfigError([f"no node named {wanted!r}{how}; the file lists: {names}"], self.source)


# --------------------------------------------------------------------------- validation

_SECTIONS = {"model": ModelConfig, "serving": ServingConfig, "supervisor": SupervisorConfig}


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (types.UnionType, typing.Union):
        return " or ".join(_type_name(a) for a in typing.get_args(tp) if a is not type(None))
    if origin is list:
        return "a list of whole numbers" if typing.get_args(tp) == (int,) else "a list of strings"
    if origin is dict or tp is dict:
        return "a table"
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(tp, str(tp))


def _toml_value(value: Any) -> str:
    """Format a value as TOML (enough for the types the config uses)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return '"' + "".join(_TOML_ESCAPES.get(ch) or (f"\\u{ord(ch):04x}" if _control(ch) else ch)
                             for ch in value) + '"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        if not value:
            return "{}"
        return "{ " + ", ".join(f"{_toml_key(k)} = {_toml_value(v)}" for k, v in value.items()) + " }"
    raise TypeError(f"cannot write {type(value).__name__} as TOML")


_TOML_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\t": "\\t", "\r": "\\r", "\b": "\\b", "\f": "\\f"}


def _control(ch: str) -> bool:
    """Characters TOML does not allow as they are in a basic string."""
    return ord(ch) < 0x20 or ord(ch) == 0x7F


def _toml_key(key: str) -> str:
    bare = key and all(c.isascii() and (c.isalnum() or c in "_-") for c in key)
    return key if bare else _toml_value(key)


def _check_type(value: Any, tp: Any) -> bool:
    origin = typing.get_origin(tp)
    if origin in (types.UnionType, typing.Union):
        return any(_check_type(value, a) for a in typing.get_args(tp))
    if tp is type(None):
        return value is None
    if origin is list:
        item = int if typing.get_args(tp) == (int,) else str
        return isinstance(value, list) and all(isinstance(v, item) and not isinstance(v, bool) for v in value)
    if origin is dict:
        inner = typing.get_args(tp)[1] if len(typing.get_args(tp)) == 2 else str
        return isinstance(value, dict) and all(isinstance(k, str) and _check_type(v, inner) for k, v in value.items())
    if tp is dict:
        return isinstance(value, dict)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, tp)


def _node_examples(i: int) -> dict[str, Any]:
    """The hints' examples for the i-th node: its own name and address, not the first node's."""
    return {"name": f"spark-{chr(ord('a') + i % 26)}", "rank": i, "address": f"192.168.100.{10 + i % 240}",
            "agent_host": f"192.168.100.{10 + i % 240}", "role": "head" if i == 0 else "worker"}


@functools.cache
def _declared(cls: type) -> tuple[dict[str, Any], dict[str, dataclasses.Field]]:
    """A section's type hints and fields, worked out once (per node they made validation slow)."""
    return typing.get_type_hints(cls), {f.name: f for f in dataclasses.fields(cls)}


def _build(cls: type, table: Any, where: str, problems: list[str], examples: dict[str, Any] | None = None) -> Any:
    if not isinstance(table, dict):
        problems.append(f"{where}: expected a table ([{where}]), got {_toml_value_safe(table)}")
        return None
    hints, fields = _declared(cls)
    kwargs: dict[str, Any] = {}
    for key, value in table.items():
        if key not in fields:
            close = difflib.get_close_matches(key, list(fields), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; known keys: {', '.join(fields)}"
            problems.append(f"{where}.{key}: unknown key{hint}")
            continue
        f = fields[key]
        example = (examples or {}).get(key, f.metadata.get("example"))
        if not _check_type(value, hints[key]):
            got = _toml_value_safe(value)
            problems.append(f"{where}.{key}: expected {_type_name(hints[key])}, got {got}; "
                            f"write e.g. {key} = {_toml_value(example)}")
            continue
        if _has_nul(value):
            problems.append(f"{where}.{key}: contains a NUL character, which no command line, environment "
                            "or path can carry; remove it")
            continue
        if hints[key] is float and isinstance(value, int) and not -2**53 <= value <= 2**53:
            problems.append(f"{where}.{key}: a {len(str(abs(value)))}-digit number is out of range; "
                            f"write e.g. {key} = {_toml_value(example)}")
            continue
        if _has_placeholder(value):
            problems.append(f"{where}.{key}: still the placeholder {PLACEHOLDER}; {f.metadata['help']} "
                            f"Write e.g. {key} = {_toml_value(example)}")
            continue
        kwargs[key] = float(value) if hints[key] is float and isinstance(value, int) else value
    for name, f in fields.items():
        if name not in kwargs and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            if name not in table:
                problems.append(f"{where}.{name}: missing; {f.metadata['help']} "
                                f"Write e.g. {name} = {_toml_value((examples or {}).get(name, f.metadata.get('example')))}")
    try:
        return cls(**kwargs)
    except TypeError:
        return None  # a missing required field, already reported


def _toml_value_safe(value: Any) -> str:
    try:
        return _toml_value(value)
    except TypeError:
        return repr(value)


def _has_nul(value: Any) -> bool:
    if isinstance(value, str):
        return "\0" in value
    if isinstance(value, list):
        return any(_has_nul(v) for v in value)
    if isinstance(value, dict):
        return any(_has_nul(k) or _has_nul(v) for k, v in value.items())
    return False


def _has_placeholder(value: Any) -> bool:
    if isinstance(value, str):
        return PLACEHOLDER in value
    if isinstance(value, list):
        return any(_has_placeholder(v) for v in value)
    if isinstance(value, dict):
        return any(_has_placeholder(v) for v in value.values())
    return False


def from_dict(data: dict, source: str | None = None) -> Cluster:
    """Validate a parsed cluster file; raise ConfigError listing every fault."""
    problems: list[str] = []
    known = set(_SECTIONS) | {"nodes"}
    for key in data:
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=1)
            hint = f"; did you mean [{close[0]}]?" if close else f"; known sections: {', '.join(sorted(known))}"
            problems.append(f"{key}: unknown section{hint}")
    if "model" not in data:
        problems.append("model: missing; add a [model] table with path = \"/path/to/model\"")
    parts = {name: _build(cls, data.get(name, {}), name, problems) for name, cls in _SECTIONS.items()}
    raw_nodes = data.get("nodes")
    nodes: list[NodeConfig] = []
    if not isinstance(raw_nodes, list) or not raw_nodes:
        problems.append("nodes: missing; add one [[nodes]] table per node (name, rank, address)")
    else:
        for i, raw in enumerate(raw_nodes):
            node = _build(NodeConfig, raw, f"nodes[{i}]", problems, _node_examples(i))
            if node is not None:
                nodes.append(node)
    if problems:
        raise ConfigError(problems, source)
    cluster = Cluster(model=parts["model"], serving=parts["serving"], supervisor=parts["supervisor"],
                      nodes=tuple(nodes), source=source)
    problems = check(cluster)
    if problems:
        raise ConfigError(problems, source)
    return cluster


def check(c: Cluster) -> list[str]:
    """Contradictions between fields: each returned line names the fields and the fix."""
    p: list[str] = []
    s, sup = c.serving, c.supervisor
    p += check_ranges(c)
    if s.gpu_memory_utilization is None and s.kv_cache_memory_bytes is None:
        p.append("serving: set gpu_memory_utilization or kv_cache_memory_bytes")
    if s.block_size is not None and s.block_size >= 1 and s.block_size & (s.block_size - 1):
        p.append(f"serving.block_size: must be a power of two, got {s.block_size}")
    if (s.long_prefill_token_threshold or 0) > s.max_model_len:
        # vLLM's SchedulerConfig refuses it at start-up.
        p.append(f"serving.long_prefill_token_threshold: {s.long_prefill_token_threshold} is above "
                 f"max_model_len ({s.max_model_len}), which vLLM refuses; lower it (e.g. 1024)")
    if s.cudagraph_capture_sizes is not None:
        if not s.cudagraph_capture_sizes:
            p.append("serving.cudagraph_capture_sizes: must list at least one size, e.g. "
                     "cudagraph_capture_sizes = [6, 12, 18, 24, 30, 36]")
        elif s.max_cudagraph_capture_size is not None \
                and s.max_cudagraph_capture_size != max(s.cudagraph_capture_sizes):
            # vLLM raises when both are given and disagree.
            p.append(f"serving.max_cudagraph_capture_size: {s.max_cudagraph_capture_size} differs from the "
                     f"largest of cudagraph_capture_sizes ({max(s.cudagraph_capture_sizes)}); set one of them")
    if s.speculative_config is not None:
        n = s.speculative_config.get("num_speculative_tokens", 0)
        if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= 64:
            p.append("serving.speculative_config.num_speculative_tokens: must be a whole number in [0, 64]")
        bad = _not_json(s.speculative_config, "serving.speculative_config", 1)
        if bad:
            p.append(bad)
    if math.isfinite(sup.stall_s) and math.isfinite(sup.liveness_interval_s) \
            and sup.stall_s < 2 * sup.liveness_interval_s:
        p.append(f"supervisor.stall_s: must be at least twice liveness_interval_s ({sup.liveness_interval_s:g} s): "
                 f"a stall is seen by comparing readings taken an interval apart; got {sup.stall_s:g}")
    p += _runtime_line_problems(s)

    # The cluster file is world-readable (and in the Nix store on NixOS): no secrets in it
    # (dspark.secret_policy says what counts as one).
    from .secret_policy import is_secret_env

    for where, env in [("serving.env", s.env)] + [(f"nodes ({n.name}).env", n.env) for n in c.nodes]:
        for key in env:
            if not ENV_NAME.fullmatch(key):
                p.append(f"{where}: {key!r} is not an environment variable name (letters, digits and _, "
                         "not starting with a digit)")
            elif is_secret_env(key):
                p.append(f"{where}.{key}: a secret does not belong in the cluster file; put it in the "
                         "service's environment file (DSPARK_API_KEY=...) or the 'api-key' credential")
    p += _check_command_line(c)
    # Counted once each (a count per node was quadratic: 15,000 nodes took 24 s).
    names: dict[str, int] = {}
    by_rank: dict[int, list[str]] = {}
    for n in c.nodes:
        names[n.name] = names.get(n.name, 0) + 1
        by_rank.setdefault(n.rank, []).append(n.name)
    for dup in sorted(k for k, v in names.items() if v > 1):
        p.append(f"nodes: the name {dup!r} is used by more than one node; give each node its own name")
    for dup in sorted(r for r, who in by_rank.items() if len(who) > 1):
        p.append(f"nodes: rank {dup} is given to more than one node ({', '.join(by_rank[dup])}); ranks must be unique")
    if sorted(by_rank) != list(range(len(c.nodes))):
        ranks = sorted(n.rank for n in c.nodes)
        shown = ", ".join(map(str, ranks[:20])) + (", ..." if len(ranks) > 20 else "")
        p.append(f"nodes: ranks must be 0..{len(c.nodes) - 1} (one per node), got [{shown}]")
    if s.tensor_parallel_size * s.pipeline_parallel_size != len(c.nodes) * s.gpus_per_node:
        p.append(f"serving.tensor_parallel_size: {s.tensor_parallel_size} x pipeline_parallel_size "
                 f"{s.pipeline_parallel_size} must equal nodes ({len(c.nodes)}) x gpus_per_node "
                 f"({s.gpus_per_node}) = {len(c.nodes) * s.gpus_per_node}")
    # Ports are grouped by the node's address, parsed (::1 and 0:0:0:0:0:0:0:1 are one host):
    # one machine, one port space (binds to 0.0.0.0 included); nodes sharing an address share a machine.
    ports: dict[tuple[Any, int], str] = {}
    for i, n in enumerate(c.nodes):
        why = _name_fault(n.name)
        shown = n.name if why is None else ascii(n.name)[1:-1]  # an invisible character shown as \\u....
        where = f"nodes[{i}] ({shown})"
        if why:
            p.append(f"nodes[{i}].name: {why}, got {ascii(n.name)}; write e.g. name = \"spark-{chr(97 + i % 26)}\"")
        addr = _node_address(n.address)
        if isinstance(addr, str):
            p.append(f"{where}.address: {addr}; write this node's fabric IP, e.g. address = \"192.168.100.10\"")
        for key in ("agent_host", "api_host"):
            value = getattr(n, key)
            if value is not None and not _is_host(value):
                p.append(f"{where}.{key}: {ascii(value)} is neither an IP address nor a host name (letters, "
                         f"digits, '-' and '.'); write e.g. {key} = \"{n.address if key == 'agent_host' else '127.0.0.1'}\" "
                         "or leave it out (the fabric address)")
        if n.role is not None and n.role not in ("head", "worker"):
            p.append(f"{where}.role: must be 'head' or 'worker', got {n.role!r}")
        elif n.role == "head" and n.rank != 0:
            p.append(f"{where}.role: the head must be rank 0, but this node has rank {n.rank}; "
                     "set rank = 0 here (and give the other node rank 1)")
        elif n.role == "worker" and n.rank == 0:
            p.append(f"{where}.role: rank 0 is the head; set role = \"head\" or give this node another rank")
        # ASCII digits only: str.isdigit() also takes "²", "٣" and "３", which NCCL cannot read.
        if n.gid_index is not None and n.gid_index != "auto" and not re.fullmatch(r"[0-9]{1,5}", n.gid_index):
            p.append(f"{where}.gid_index: must be a number or \"auto\" (a number in ASCII digits, e.g. \"3\"), "
                     f"got {ascii(n.gid_index)}")
        if n.gid_index == "auto" and _is_ipv6(n.address):
            p.append(f"{where}.gid_index: \"auto\" finds the RoCEv2 GID of an IPv4 address, and {n.address} is "
                     "IPv6; give the GID index as a number (show_gids lists them)")
        if n.allow_default_route and n.socket_ifname is None:
            p.append(f"{where}.allow_default_route: allows socket_ifname to carry the default route, and no "
                     "socket_ifname is set; set socket_ifname or remove allow_default_route")
        if n.gid_index is not None and n.rdma_device is None:
            p.append(f"{where}.gid_index: needs rdma_device (the GID belongs to an RDMA device)")
        for key in ("api_port", "master_port", "agent_port"):
            port = getattr(n, key)
            if not 0 < port < 65536:
                p.append(f"{where}.{key}: {port} is not a TCP port (1..65535)")
        used = [("agent_port", n.agent_port)]
        if n.is_head:
            used += [("api_port", n.api_port), ("master_port", n.master_port)]
        host = addr if not isinstance(addr, str) else n.address
        for key, port in used:
            who = f"{shown}.{key}"
            if (host, port) in ports:
                p.append(f"port {port} is used twice on host {n.address}: {ports[host, port]} and {who}; "
                         "give one of them another port")
            else:
                ports[host, port] = who
    return p


# The options dspark writes on vLLM's command line from the fields (render.vllm_argv; the test
# test_config_refusals.test_every_flag_render_writes_is_owned keeps the two in step), with the
# field to set instead. argparse takes `--opt=v`, `--opt_name` (vLLM reads _ as -), an
# unambiguous abbreviation (`--node-r`), `--opt.key=v` for a JSON option, and `--no-opt` for a
# switch: each of those is the same option.
DSPARK_FLAGS = {
    "--model": "model.path", "--served-model-name": "model.served_name",
    "--trust-remote-code": "model.trust_remote_code",
    "--host": "the head's api_host", "--port": "the head's api_port",
    "--tensor-parallel-size": "serving.tensor_parallel_size", "-tp": "serving.tensor_parallel_size",
    "--pipeline-parallel-size": "serving.pipeline_parallel_size", "-pp": "serving.pipeline_parallel_size",
    "--kv-cache-dtype": "serving.kv_cache_dtype", "--block-size": "serving.block_size",
    "--max-model-len": "serving.max_model_len", "--max-num-seqs": "serving.max_num_seqs",
    "--max-num-batched-tokens": "serving.max_num_batched_tokens",
    "--long-prefill-token-threshold": "serving.long_prefill_token_threshold",
    "--max-cudagraph-capture-size": "serving.max_cudagraph_capture_size",
    "--cudagraph-capture-sizes": "serving.cudagraph_capture_sizes",
    "--kv-cache-memory-bytes": "serving.kv_cache_memory_bytes",
    "--gpu-memory-utilization": "serving.gpu_memory_utilization",
    "--load-format": "serving.load_format", "--moe-backend": "serving.moe_backend",
    "--enable-prefix-caching": "serving.enable_prefix_caching", "--async-scheduling": "serving.async_scheduling",
    "--enable-chunked-prefill": "serving.enable_chunked_prefill",
    "--skip-tokenizer-init": "serving.skip_tokenizer_init",
    "--speculative-config": "serving.speculative_config",
    "--distributed-executor-backend": "nothing (dspark runs vLLM's mp backend on every node)",
    "--nnodes": "the [[nodes]] list", "-n": "the [[nodes]] list",
    "--node-rank": "the node's rank", "-r": "the node's rank",
    "--master-addr": "the head's address", "--master-port": "the head's master_port",
    "--headless": "the node's rank (every rank but 0 runs headless)",
    "--shutdown-timeout": "supervisor.drain_s",
}


def owned_flag(arg: str) -> str | None:
    """The DSPARK_FLAGS option `arg` sets (in any spelling argparse takes), or None."""
    if not arg.startswith("-") or arg == "-" or arg[1:2].isdigit():
        return None
    dashes = "--" if arg.startswith("--") else "-"
    name = arg[len(dashes):].split("=", 1)[0].split(".", 1)[0].replace("_", "-")
    if dashes == "-":
        return "-" + name if "-" + name in DSPARK_FLAGS else None
    if name.startswith("no-") and "--" + name[3:] in DSPARK_FLAGS:
        name = name[3:]
    if "--" + name in DSPARK_FLAGS:
        return "--" + name
    if len(name) >= 3:  # argparse's abbreviations (vLLM's parser keeps allow_abbrev on)
        hits = [f for f in DSPARK_FLAGS if f.startswith("--" + name)]
        if hits:
            return hits[0]
    return None


def _check_command_line(c: Cluster) -> list[str]:
    """What dspark puts on vLLM's command line: no secret (ps shows it), nothing vLLM reads
    as an option where a value belongs, no option dspark sets itself, no argument too long."""
    from .secret_policy import secret_args, secret_keys

    p: list[str] = []
    m, s = c.model, c.serving
    for key in ("path", "served_name"):
        value = getattr(m, key)
        if value.startswith("-"):  # the value itself is not echoed: it may be a secret
            p.append(f"model.{key}: starts with '-', which vLLM would read as an option (and ps would show); "
                     f"write a {'directory' if key == 'path' else 'name'}, e.g. {key} = "
                     f"{_toml_value(dataclasses.fields(ModelConfig)[0 if key == 'path' else 1].metadata['example'])}")
        elif not value:
            p.append(f"model.{key}: empty; write e.g. {key} = \"deepseek-v4-flash\"" if key == "served_name"
                     else "model.path: empty; write the model directory, e.g. path = \"/var/lib/dspark/models/x\"")
        if len(value) > MAX_ARG_CHARS:
            p.append(f"model.{key}: {len(value)} characters, longer than {MAX_ARG_CHARS}")
    if not s.vllm_command or not s.vllm_command[0]:
        p.append("serving.vllm_command: must name vLLM's CLI, e.g. vllm_command = [\"vllm\"] or "
                 "[\"/opt/runtime/bin/vllm\"]")
    commands = [(f"serving.line_commands.{_toml_key(k)}", v) for k, v in s.line_commands.items()]
    for where, args in (("serving.extra_args", s.extra_args), ("serving.vllm_command", s.vllm_command), *commands):
        for flag in secret_args(args):
            p.append(f"{where}: {flag} takes a secret, which does not belong in the cluster file nor on "
                     "vLLM's command line (ps shows it); the API key goes in the 'api-key' credential or "
                     "DSPARK_API_KEY in the service's environment file")
        long = [a for a in args if len(a) > MAX_ARG_CHARS]
        if long:
            p.append(f"{where}: an argument of {len(long[0])} characters, longer than {MAX_ARG_CHARS}; vLLM's "
                     "options and paths are shorter")
    for arg in s.extra_args:
        flag = owned_flag(arg)
        if flag:
            shown = arg.split("=", 1)[0]
            p.append(f"serving.extra_args: {shown} sets {flag}, which dspark writes itself from "
                     f"{DSPARK_FLAGS[flag]}; set that instead and remove {shown} from extra_args")
    if s.speculative_config is not None:
        for where in secret_keys(s.speculative_config, "serving.speculative_config"):
            p.append(f"{where}: a secret does not belong in the cluster file nor on vLLM's command line "
                     "(speculative_config is passed as JSON in --speculative-config); remove it")
    return p


def _node_address(address: str) -> Any:
    """The node's address parsed, or why it cannot be a node's address."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return f"{ascii(address)} is not an IP address"
    if ip.is_unspecified:
        return f"{address} is the unspecified address (any), which no peer can reach"
    if ip.is_multicast:
        return f"{address} is a multicast address, not one host's"
    if ip.version == 4 and ip.is_reserved:  # 240.0.0.0/4, 255.255.255.255 (broadcast) included
        return f"{address} is reserved or the broadcast address, not one host's"
    return ip


def _is_host(value: str) -> bool:
    """An IP address or a host name: nothing a URL or a shell would read more into."""
    try:
        ipaddress.ip_address(value)
        return True
    except ValueError:
        pass
    name = value[:-1] if value.endswith(".") else value
    return 0 < len(name) <= 253 and all(_HOST_LABEL.fullmatch(label) for label in name.split("."))


def _name_fault(name: str) -> str | None:
    """Why a node name cannot be used: it names the node in logs, units, the dashboard and
    --node, so it is printable and has nothing invisible (zero-width, bidi, control, spaces)."""
    if not name:
        return "empty"
    if len(name) > 253:
        return f"{len(name)} characters (at most 253: a host name's length)"
    for ch in name:
        if not ch.isprintable() or ch.isspace() or unicodedata.category(ch) in ("Cf", "Cc", "Co", "Cn", "Zs", "Zl", "Zp"):
            return f"holds {unicodedata.name(ch, 'U+%04X' % ord(ch))} (U+{ord(ch):04X}), an invisible, space or control character"
    return None


def _runtime_line_problems(s: ServingConfig) -> list[str]:
    """The runtime line exists and honours the settings (dspark.runtime_lines says how each line
    names them, and why it refuses one)."""
    from . import runtime_lines

    lines = runtime_lines.load()
    p: list[str] = []
    for line, command in s.line_commands.items():
        where = f"serving.line_commands.{_toml_key(line)}"
        if line not in lines.lines:
            p.append(runtime_lines.unknown_line_message(line, lines).replace("serving.runtime_line", where))
        elif not command or not command[0]:
            p.append(f"{where}: must name that line's vLLM CLI, e.g. [\"/opt/dspark/lines/{line}/bin/vllm\"]")
        elif line == s.runtime_line and command != s.vllm_command:
            p.append(f"{where}: differs from serving.vllm_command, which is the command of the file's own line "
                     f"({line}); make them the same or drop this entry")
    if s.runtime_line not in lines.lines:
        return p + [runtime_lines.unknown_line_message(s.runtime_line, lines)]
    return p + runtime_lines.refusals(s.runtime_line, {k: getattr(s, k) for k in runtime_lines.SETTINGS}, lines)


def check_ranges(c: Cluster) -> list[str]:
    """Every number is finite and within its declared range (the `bounds` of its field)."""
    p: list[str] = []
    parts = [(name, getattr(c, name)) for name in _SECTIONS] + [(f"nodes[{i}] ({n.name})", n)
                                                               for i, n in enumerate(c.nodes)]
    for where, obj in parts:
        for f in dataclasses.fields(obj):
            value, bounds = getattr(obj, f.name), f.metadata.get("bounds")
            if bounds is None or value is None or isinstance(value, bool):
                continue
            if isinstance(value, list):  # a list of numbers: every item within the range
                value = next((v for v in value if not bounds[0] <= v <= bounds[1]), None)
                if value is None:
                    continue
            lo, hi = bounds
            positive = f.metadata.get("positive")
            ok = math.isfinite(value) and (lo < value if positive else lo <= value) and value <= hi
            if ok:
                continue
            if f.name.endswith("_s"):
                what = (f"a positive, finite number of seconds (at most {hi:g})" if positive or not lo else
                        f"a positive, finite number of seconds, at least {lo:g} and at most {hi:g}")
            elif isinstance(value, int):
                what = f"a whole number in [{lo:g}, {hi:g}]"
            else:
                what = f"in {'(' if positive else '['}{lo:g}, {hi:g}] (a finite number)"
            p.append(f"{where}.{f.name}: must be {what}, got {value}; write e.g. "
                     f"{f.name} = {_toml_value(f.metadata.get('example'))}")
    return p


def _is_ipv6(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).version == 6
    except ValueError:
        return False


def _not_json(value: Any, where: str, depth: int) -> str | None:
    """Why a table cannot be passed to vLLM as JSON (a TOML date, an infinite number, too deep)."""
    if depth > MAX_DEPTH:
        return f"{where}: nested more than {MAX_DEPTH} levels deep"
    if isinstance(value, dict):
        for k, v in value.items():
            why = _not_json(v, f"{where}.{k}", depth + 1)
            if why:
                return why
        return None
    if isinstance(value, list):
        for i, v in enumerate(value):
            why = _not_json(v, f"{where}[{i}]", depth + 1)
            if why:
                return why
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return f"{where}: {value} is not a finite number"
    if value is None or isinstance(value, (str, int, float, bool)):
        return None
    return f"{where}: a TOML {type(value).__name__} cannot be passed to vLLM; write it as a string or a number"


def _read_text(path: Path) -> str:
    """The file's text: a regular file (not a FIFO or a device: opened without blocking and
    refused), at most MAX_FILE_BYTES, UTF-8."""
    from .safe_read import FileTooLarge, NotRegularFile, read_bytes  # the one guarded reader

    try:
        data = read_bytes(path, MAX_FILE_BYTES)
    except FileNotFoundError:
        raise ConfigError([f"file not found; create one with: dspark config init {path}"], str(path)) from None
    except NotRegularFile:
        raise ConfigError(["not a regular file (a directory, FIFO or device); point --config at the "
                           "cluster file itself"], str(path)) from None
    except FileTooLarge:
        raise ConfigError([f"larger than {MAX_FILE_BYTES // 1024} KiB; a cluster file is a few KiB"], str(path)) from None
    except OSError as e:
        raise ConfigError([f"cannot read: {e.strerror}"], str(path)) from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError([f"not UTF-8 text (byte {e.start}: {data[e.start:e.start + 1]!r}); TOML files are "
                           "UTF-8"], str(path)) from None


def _depth(value: Any, limit: int) -> int:
    if limit < 0:
        return 0
    if isinstance(value, dict):
        return 1 + max((_depth(v, limit - 1) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((_depth(v, limit - 1) for v in value), default=0)
    return 0


def load(path: str | os.PathLike | None = None) -> Cluster:
    """Read and validate the cluster file ($DSPARK_CONFIG or /etc/dspark/cluster.toml by default)."""
    path = Path(path or os.environ.get("DSPARK_CONFIG") or DEFAULT_CONFIG_PATH)
    text = _read_text(path)
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError([f"not valid TOML: {e}"], str(path)) from None
    except RecursionError:
        raise ConfigError([f"nested too deeply (a cluster file is at most {MAX_DEPTH} levels)"], str(path)) from None
    if _depth(data, MAX_DEPTH + 1) > MAX_DEPTH:
        raise ConfigError([f"nested more than {MAX_DEPTH} levels deep; a cluster file needs 4"], str(path))
    return from_dict(data, str(path))


def to_dict(c: Cluster) -> dict:
    out = {name: dataclasses.asdict(getattr(c, name)) for name in _SECTIONS}
    out["nodes"] = [dataclasses.asdict(n) for n in c.nodes]
    return _drop_none(out)


def _drop_none(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _drop_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_none(v) for v in value]
    return value


def dumps(data: dict, comments: bool = False, derived: dict[str, dict[str, Any]] | None = None) -> str:
    """Write a cluster dict as TOML; with comments, each field carries its help text and source.
    `derived` (section -> field -> value) adds unset fields as commented-out lines showing the
    value they follow from the others."""
    lines: list[str] = []
    classes = dict(_SECTIONS, nodes=NodeConfig)

    def table(cls: type, values: dict, unset: dict[str, Any] | None = None) -> None:
        meta = {f.name: f.metadata for f in dataclasses.fields(cls)}
        for key, value in [*values.items(), *(unset or {}).items()]:
            if comments and meta.get(key, {}).get("help"):
                lines.append(f"# {meta[key]['help']}")
            if comments and meta.get(key, {}).get("source"):
                lines.extend(textwrap.wrap(f"Source: {meta[key]['source']}", 96, initial_indent="# ",
                                           subsequent_indent="#   ", break_on_hyphens=False))
            line = f"{_toml_key(key)} = {_toml_value(value)}"
            lines.append(line if key in values else f"# {line}  (unset: follows the settings above)")

    for name in ("model", "serving", "supervisor"):
        if name in data:
            lines.append(f"[{name}]")
            table(classes[name], data[name], (derived or {}).get(name) if comments else None)
            lines.append("")
    for node in data.get("nodes", []):
        lines.append("[[nodes]]")
        table(NodeConfig, node)
        lines.append("")
    return "\n".join(lines)


def template() -> str:
    """The commented template `dspark config init` writes: the seed's tested settings for
    DeepSeek V4 Flash on two GB10 nodes, with CHANGEME where only the operator knows."""
    data = {
        "model": {"path": f"/var/lib/dspark/models/{PLACEHOLDER}", "served_name": "deepseek-v4-flash",
                  "trust_remote_code": True},
        "serving": _drop_none(dataclasses.asdict(ServingConfig())),
        "supervisor": dataclasses.asdict(SupervisorConfig()),
        "nodes": [
            {"name": PLACEHOLDER + "-head-hostname", "rank": 0, "role": "head", "address": PLACEHOLDER,
             "socket_ifname": PLACEHOLDER, "rdma_device": PLACEHOLDER, "gid_index": "auto",
             "api_port": 8888, "master_port": 25000, "agent_port": 8890},
            {"name": PLACEHOLDER + "-worker-hostname", "rank": 1, "role": "worker", "address": PLACEHOLDER,
             "socket_ifname": PLACEHOLDER, "rdma_device": PLACEHOLDER, "gid_index": "auto", "agent_port": 8890},
        ],
    }
    header = (
        "# dspark cluster file: one description of the deployment, the same file on every node.\n"
        "# Each process finds its own [[nodes]] entry by name (default: the host name).\n"
        "# Replace every CHANGEME; use the dedicated fabric addresses, not Wi-Fi or the LAN.\n"
        "# The head's API binds its fabric address (only the nodes reach it); to open it, set api_host =\n"
        "# \"0.0.0.0\" in its [[nodes]] entry and an API key (dspark check warns on an open API).\n"
        "# Defaults are the tested settings for DeepSeek V4 Flash on two GB10 nodes (TP=2); each serving\n"
        "# setting says where it comes from (a public measurement on GB10, or vLLM's code).\n"
        "# Left unset on purpose:\n"
        + "".join("\n".join(textwrap.wrap(note, 96, initial_indent="# - ", subsequent_indent="#   ",
                                                break_on_hyphens=False)) + "\n"
                  for note in NOT_SET)
        + "# Check it with: dspark config check\n\n"
    )
    serving = ServingConfig()
    derived = {"serving": {"cudagraph_capture_sizes": serving.capture_sizes}} if serving.capture_sizes else {}
    return header + dumps(data, comments=True, derived=derived)
