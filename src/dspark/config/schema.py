"""The cluster file's schema: every field declared once, with its type, default, help text,
example and source (`_f`), in the sections a file has ([model], [serving], [supervisor],
[[nodes]]) and the Cluster they make. The validator (dspark.config.validate), the error messages and
the commented template (dspark.config.template) are derived from these declarations.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dspark.config.toml import toml_value
from dspark.engine.graph_dispatch import covering_sizes, draft_query_len

DEFAULT_CONFIG_PATH = Path("/etc/dspark/cluster.toml")
PLACEHOLDER = "CHANGEME"
GIB = 1024**3
DAY_S = 86400.0
# The shortest interval or timeout the supervisor takes: below it a loop spins (1e-300 s ran a
# core flat out) and no HTTP answer or process exit can be waited for.
MIN_SECONDS = 0.1


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
       bounds: tuple[float, float] | None = None, positive: bool = False,
       source: str | None = None) -> Any:  # a field, as its default
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
    "VLLM_SHM_BROADCAST_BUSY_LOOP_S, the seconds vLLM's shm_broadcast readers busy-loop after each "
    "message (overlay 0013, on every line): unset, the overlay's 0.002 s applies. The 2 ms is "
    "MiaAI-Lab PR #71's, measured on a TP=2 GB10 pair: 333% CPU and the SoC 11 C hotter at vLLM's "
    "fixed 1 s, 89% at 2 ms with the same throughput. Set it in serving.env to change it (1 is stock "
    "vLLM's 1 s); vLLM refuses anything but a finite number >= 0.",
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
        example={"v0.32.0": ["/opt/dspark/lines/v0.32.0/bin/vllm"]}, factory=dict,
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
    limit_mm_per_prompt: dict[str, int] | None = _f(
        None, help="Images (or other media) one prompt may carry, by modality (vLLM --limit-mm-per-prompt); "
                   "omit for vLLM's own limit. A multimodal checkpoint (DeepSeek-V4-Flash-Vision-Exp) needs a "
                   "runtime line that serves it (v0.32.0); {image = 0} serves it as text only.",
        example={"image": 4}, bounds=(0, 1024),
        source="vLLM's default (unset: 999 of each); vLLM 0.32.0's DeepSeek V4 VL model skips its vision tower at "
               "{image = 0} (models/deepseek_v4/common/vl_model.py)")
    allowed_origins: list[str] = _f(
        help="Web origins whose pages may call the API from a browser (CORS, vLLM --allowed-origins); "
             "empty: none. The API key guards every route but /health either way.",
        example=["https://chat.example.org"], factory=list,
        source="dspark's choice: vLLM's default (every origin, \"*\") lets any page a user opens run "
               "inference on a head the user's browser reaches")
    enable_prefix_caching: bool = _f(True, help="Reuse KV of shared prompt prefixes.", example=True, source=_SEED)
    enable_chunked_prefill: bool = _f(True, help="Split long prompts into scheduler-sized chunks.", example=True,
                                      source=_SEED)
    async_scheduling: bool = _f(True, help="Overlap scheduling with execution.", example=True, source=_SEED)
    moe_backend: str | None = _f("flashinfer_b12x", help="MoE experts backend: flashinfer_b12x is b12x at W4A16 "
                                                         "(the overlay's on v0.28.0, upstream's b12x on v0.32.0); on "
                                                         "v0.32.0 \"b12x\" asks for upstream's W4A8, unmeasured "
                                                         "on GB10.",
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
                   "decoding: every multiple of (speculative tokens + 1) up to the largest capture size, "
                   "plus, for DSpark's draft (k tokens a request), each n x k that no multiple rounds to "
                   "(5, 6, 12, 18, 24, 30, 35, 36, ..., 72); without: vLLM's own list. dspark config check "
                   "refuses a list that leaves a decode batch of 1..max_num_seqs requests without a FULL "
                   "graph, naming the sizes to add.",
        example=[5, 6, 12, 18, 24, 30, 35, 36], bounds=(1, 1 << 20),
        source="vLLM 0.28.0's model runner v2 (which DSpark forces) replays a FULL decode graph for n "
               "requests only at a captured size rounded up to whole requests of at least n's tokens "
               "(v1/worker/gpu/cudagraph_utils.py): with its default sizes 1, 2, 4, 8, ..., 72, batches "
               "of 5 and 9 requests verify PIECEWISE; with multiples of k + 1 alone the draft's 1 and 7 "
               "requests were padded and, wherever k + 1 divides max_num_seqs - 1 (13 x 5), its last "
               "batch ran eager (tests/overlay/test_graph_grid.py: S 1..64 x k 1..7, both lines)")
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
        (no speculative decoding). With k speculative tokens every batch of n requests verifies
        n x (k + 1) rows, and vLLM's model runner v2 replays a FULL decode graph only at a size
        that is a multiple of a batch's tokens a request, so every multiple of k + 1 up to the
        largest size is captured; DSpark's draft runs k tokens a request, and vLLM rounds each
        size up to a multiple of k for it, so n x k is added for each n that no multiple of
        k + 1 rounds to (dspark.engine.graph_dispatch.covering_sizes)."""
        if self.cudagraph_capture_sizes is not None:
            return sorted(set(self.cudagraph_capture_sizes))
        k = self.num_speculative_tokens
        if k == 0:
            return None
        return covering_sizes(self.max_num_seqs, k, self.cudagraph_capture_size,
                              draft_query_len(self.speculative_config))


@dataclass(frozen=True)
class SupervisorConfig:
    ready_timeout_s: float = _f(1800.0, help="Give up (exit 'never ready') if vLLM is not serving by then.",
                                example=1800.0, bounds=(MIN_SECONDS, DAY_S))
    liveness_interval_s: float = _f(5.0, help="Seconds between the head's liveness rounds: a /metrics reading "
                                              "(progress while requests run or wait), and a real 1-token completion "
                                              "only while the engine is idle.",
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

    def on_line(self, line: str) -> Cluster:
        """This cluster as a node runs it on runtime line `line`: the line's command from
        serving.line_commands (vllm_command for the file's own line when the table lacks it).
        Raises ConfigError for a line with no command here."""
        s = self.serving
        command = s.line_commands.get(line) or (s.vllm_command if line == s.runtime_line else None)
        if not command:
            from dspark.lines import runtime as runtime_lines

            lines = runtime_lines.load()
            if line in lines.retired:
                raise ConfigError([runtime_lines.unknown_line_message(line, lines)], self.source)
            installed = sorted({s.runtime_line, *s.line_commands})
            raise ConfigError([f"serving.line_commands: runtime line {line!r} is not installed on the nodes "
                               f"(installed: {', '.join(installed)}); add its vLLM command, e.g. "
                               f"line_commands = {{ {toml_value(line)} = [\"/path/to/{line}/bin/vllm\"] }}"],
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


SECTIONS = {"model": ModelConfig, "serving": ServingConfig, "supervisor": SupervisorConfig}
