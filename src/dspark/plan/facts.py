"""Model facts: what the plan knows from the model directory alone (config.json and the
safetensors headers, never the tensor data), and the fixed facts it plans with: one GB10
node's usable memory, the seed's serving settings, vLLM's defaults, the calibrated runtime
reserve."""

from __future__ import annotations

import math
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from dspark.files.safe_read import (
    MAX_MODEL_CONFIG_BYTES,
    JSONRefused,
    open_regular,
    parse_json,
    read_at_most,
    read_json,
)

GiB = 1 << 30

# The serving settings the plan assumes when told nothing are the cluster file's own defaults
# (dspark.config.validate's [serving] fields: the seed's tested settings on one GB10 node): one fact,
# one place.
def serving_default(name: str) -> Any:
    """The cluster file's default for a [serving] field."""
    import dataclasses

    from dspark.config.schema import ServingConfig

    fields = getattr(ServingConfig, "model_fields", None)  # a pydantic model, should it become one
    if fields is not None:
        return fields[name].get_default(call_default_factory=True)
    f = {f.name: f for f in dataclasses.fields(ServingConfig)}[name]
    # no default: then a default_factory (every [serving] field has one or the other)
    return cast(Callable[[], Any], f.default_factory)() if f.default is dataclasses.MISSING else f.default


GB10_USABLE_MEMORY_BYTES = int(serving_default("usable_memory_gib") * GiB)  # about 121 GiB
SEED_MAX_MODEL_LEN = serving_default("max_model_len")
SEED_MAX_NUM_SEQS = serving_default("max_num_seqs")
SEED_MAX_NUM_BATCHED_TOKENS = serving_default("max_num_batched_tokens")
SEED_GPU_MEMORY_UTILIZATION = serving_default("gpu_memory_utilization")
SEED_ASYNC_SCHEDULING = serving_default("async_scheduling")
SEED_LONG_PREFILL_TOKEN_THRESHOLD = serving_default("long_prefill_token_threshold")

# The safetensors format caps the header at 100 MB (safetensors' own
# MAX_HEADER_SIZE); anything larger is a corrupt or foreign file.
_MAX_HEADER_BYTES = 100_000_000

# vLLM's CUDA default (vllm/config/cache.py, CacheConfig.DEFAULT_BLOCK_SIZE).
_DEFAULT_BLOCK_SIZE = 16
# DeepSeek V4 runs with 256-token blocks: the seed passes --block-size 256 and
# vLLM's DSv4 caches are laid out for it ("The C4A KV block shape [256//4, ...]"
# in vllm/v1/attention/backends/mla/sparse_swa.py).
_DSV4_DEFAULT_BLOCK_SIZE = 256

# Runtime reserve for DeepSeek V4 (activation peak, CUDA graphs, non-torch
# allocations and the buffers vLLM allocates while building the model, such as
# RoPE caches), derived from the reference run on two GB10 nodes
# (deepseek-v4-flash.md: TP=2, gpu_memory_utilization 0.78, max_model_len
# 350000, 12 seqs, MTP 5 -> 79.17 GiB model memory, 10.74 GiB KV per rank):
#   0.78 * 121 GiB budget                      = 94.38 GiB
#   - 10.74 GiB KV cache                       = 83.64 GiB
#   - 78.42 GiB checkpoint weights on one rank (this module's figure for that
#     checkpoint at TP=2 with its drafter)     =  5.22 GiB
# vLLM reported 79.17 GiB of model memory, so 0.75 GiB of this reserve is the
# model-construction buffers and 4.47 GiB is the rest. It grows with
# max_num_batched_tokens and the CUDA-graph capture sizes; pass
# runtime_overhead_bytes to override it.
DSV4_RUNTIME_OVERHEAD_BYTES = round(5.22 * GiB)

# Bytes of one element of each safetensors dtype (the safetensors format's
# dtype list). Only used to check shapes against data_offsets; the byte count
# itself always comes from data_offsets.
_DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}

_KV_DTYPE_BYTES = {
    "bfloat16": 2, "float16": 2, "half": 2, "float32": 4, "float": 4,
    "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "fp8_inc": 1,
}


class PlanError(Exception):
    """The model directory cannot be planned; the message names the file."""


# --------------------------------------------------------------------------
# Model facts: config.json + safetensors headers
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    shard: str


@dataclass(frozen=True)
class ModelFacts:
    model_dir: Path
    config: dict[str, Any]
    tensors: tuple[TensorInfo, ...]
    shard_file_bytes: int  # the shards' sizes on disk, headers included

    @property
    def model_type(self) -> str:
        return str(self.config.get("model_type", ""))

    @property
    def architecture(self) -> str:
        archs = self.config.get("architectures") or [""]
        return str(archs[0])

    @property
    def is_deepseek_v4(self) -> bool:
        return self.model_type == "deepseek_v4" or "compress_ratios" in self.config

    @property
    def weight_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def bytes_by_dtype(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for t in self.tensors:
            out[t.dtype] = out.get(t.dtype, 0) + t.nbytes
        return dict(sorted(out.items()))


def _read_json(path: Path) -> dict[str, Any]:
    try:  # a regular file of at most MAX_MODEL_CONFIG_BYTES: a FIFO or /dev/zero is refused at once
        data = read_json(path, MAX_MODEL_CONFIG_BYTES)
    except FileNotFoundError:
        raise PlanError(f"{path}: missing (a model directory needs config.json)") from None
    except OSError as exc:
        raise PlanError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except JSONRefused as exc:
        raise PlanError(f"{path}: not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise PlanError(f"{path}: expected a JSON object")
    return data


def read_safetensors_header(path: Path) -> tuple[list[TensorInfo], int]:
    """Parse one shard's header; returns its tensors and its size on disk."""
    try:  # a regular file (safe_read): a FIFO or a device named *.safetensors is refused at once
        with open_regular(path) as f:
            head = read_at_most(f, 8)
            if len(head) < 8:
                raise PlanError(f"{path}: too short for a safetensors header")
            (n,) = struct.unpack("<Q", head)
            size = os.fstat(f.fileno()).st_size
            if n > _MAX_HEADER_BYTES or 8 + n > size:
                raise PlanError(f"{path}: corrupt safetensors header length {n}")
            raw = read_at_most(f, n)
    except OSError as exc:
        raise PlanError(f"{path}: cannot read: {exc.strerror or exc}") from None
    try:
        header = parse_json(raw, max_bytes=_MAX_HEADER_BYTES)
    except JSONRefused as exc:
        raise PlanError(f"{path}: corrupt safetensors header: {exc}") from None
    if not isinstance(header, dict):
        raise PlanError(f"{path}: corrupt safetensors header: not a JSON object")
    data_bytes = size - 8 - n
    tensors = []
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = str(meta["dtype"])
            shape = tuple(int(d) for d in meta["shape"])
            begin, end = (int(o) for o in meta["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise PlanError(f"{path}: corrupt safetensors header entry {name!r}") from None
        if not 0 <= begin <= end <= data_bytes:
            raise PlanError(
                f"{path}: tensor {name!r} lies outside the file (truncated download?)"
            )
        width = _DTYPE_BYTES.get(dtype)
        if width is not None and math.prod(shape) * width != end - begin:
            raise PlanError(f"{path}: tensor {name!r}: shape and data_offsets disagree")
        tensors.append(TensorInfo(name, dtype, shape, end - begin, path.name))
    return tensors, size


def load_model_facts(model_dir: Path | str) -> ModelFacts:
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise PlanError(f"{model_dir}: not a directory")
    config = _read_json(model_dir / "config.json")
    if not isinstance(config.get("num_hidden_layers"), int):
        raise PlanError(f"{model_dir / 'config.json'}: no integer num_hidden_layers")
    tensors: list[TensorInfo] = []
    shard_bytes = 0
    for shard in sorted(model_dir.glob("*.safetensors")):
        found, size = read_safetensors_header(shard)
        tensors.extend(found)
        shard_bytes += size
    return ModelFacts(model_dir, config, tuple(tensors), shard_bytes)


