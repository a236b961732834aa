"""The options dspark writes on vLLM's command line, each with the cluster file's field (or the
words) a user sets instead: one table. `dspark.node.launch.vllm_argv` writes the serving fields'
options from it (in its order), and the validator (`dspark.config.command_line.owned_flag`) refuses
each of its options in `serving.extra_args`, naming the field."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Form(StrEnum):
    VALUE = "value"    # `--opt <serving.field>`, left out when the field is None
    LIST = "list"      # `--opt a b c`, left out when None
    SWITCH = "switch"  # `--opt`, when the field is true
    JSON = "json"      # `--opt '<compact JSON>'`, when the field is set
    FIXED = "fixed"    # written by launch itself (the model, the rendezvous, the guard ...)


@dataclass(frozen=True)
class Flag:
    option: str
    instead: str  # the field (serving.<attr> for the serving forms) or the words a refusal names
    form: Form = Form.FIXED
    short: str | None = None  # argparse's short spelling

    @property
    def attr(self) -> str:
        """The ServingConfig attribute a serving form reads."""
        return self.instead.removeprefix("serving.")


NODES = "the [[nodes]] list"
RANK = "the node's rank"

FLAGS: tuple[Flag, ...] = (
    Flag("--model", "model.path"),
    Flag("--served-model-name", "model.served_name"),
    Flag("--trust-remote-code", "model.trust_remote_code"),
    Flag("--host", "the head's api_host"),
    Flag("--port", "the head's api_port"),
    Flag("--tensor-parallel-size", "serving.tensor_parallel_size", short="-tp"),
    Flag("--pipeline-parallel-size", "serving.pipeline_parallel_size", short="-pp"),
    Flag("--kv-cache-dtype", "serving.kv_cache_dtype", Form.VALUE),
    Flag("--block-size", "serving.block_size", Form.VALUE),
    Flag("--max-model-len", "serving.max_model_len", Form.VALUE),
    Flag("--max-num-seqs", "serving.max_num_seqs", Form.VALUE),
    Flag("--max-num-batched-tokens", "serving.max_num_batched_tokens", Form.VALUE),
    Flag("--long-prefill-token-threshold", "serving.long_prefill_token_threshold", Form.VALUE),
    Flag("--max-cudagraph-capture-size", "serving.max_cudagraph_capture_size", Form.VALUE),
    Flag("--cudagraph-capture-sizes", "serving.cudagraph_capture_sizes", Form.LIST),
    Flag("--kv-cache-memory-bytes", "serving.kv_cache_memory_bytes", Form.VALUE),
    Flag("--gpu-memory-utilization", "serving.gpu_memory_utilization", Form.VALUE),
    Flag("--load-format", "serving.load_format", Form.VALUE),
    Flag("--moe-backend", "serving.moe_backend", Form.VALUE),
    Flag("--enable-prefix-caching", "serving.enable_prefix_caching", Form.SWITCH),
    Flag("--async-scheduling", "serving.async_scheduling", Form.SWITCH),
    Flag("--enable-chunked-prefill", "serving.enable_chunked_prefill", Form.SWITCH),
    Flag("--skip-tokenizer-init", "serving.skip_tokenizer_init", Form.SWITCH),
    Flag("--speculative-config", "serving.speculative_config", Form.JSON),
    Flag("--limit-mm-per-prompt", "serving.limit_mm_per_prompt", Form.JSON),
    Flag("--allowed-origins", "serving.allowed_origins"),
    Flag("--middleware", "nothing (dspark adds its API guard; vLLM takes one list of middleware)"),
    Flag("--distributed-executor-backend", "nothing (dspark runs vLLM's mp backend on every node)"),
    Flag("--nnodes", NODES, short="-n"),
    Flag("--node-rank", RANK, short="-r"),
    Flag("--master-addr", "the head's address"),
    Flag("--master-port", "the head's master_port"),
    Flag("--headless", "the node's rank (every rank but 0 runs headless)"),
    Flag("--shutdown-timeout", "supervisor.drain_s"),
)


def of_form(form: Form) -> tuple[Flag, ...]:
    return tuple(f for f in FLAGS if f.form == form)


# option (either spelling) -> what to set instead
DSPARK_FLAGS: dict[str, str] = {
    spelling: f.instead for f in FLAGS for spelling in (f.option, *((f.short,) if f.short else ()))}
