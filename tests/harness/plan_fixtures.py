"""Header-only model directories for the memory-plan tests.

``write_dsv4_flash_checkpoint`` writes a DeepSeek-V4-Flash-shaped checkpoint:
48 safetensors shards whose headers list every tensor of the published
DSpark-variant checkpoint (its name, dtype and shape) while the data region is
left as a sparse hole, so 155 GiB of "weights" use no disk.

Where the shapes come from: the architecture in
shared/reference/deepseek-v4-flash-config.json and these conventions of the
published checkpoint, seen in public tooling that validates it:
- native names (``layers.N.attn.wq_a.weight``, ``layers.N.ffn.experts.E.w1``,
  ``mtp.S.*``) rather than Hugging Face's ``model.layers.N...``;
- FP8 e4m3 linear weights with one ue8m0 (F8_E8M0) scale per 128x128 block;
- MXFP4 routed experts stored as I8 with two values per byte, plus one ue8m0
  scale per 32 values;
- BF16 embeddings, norms, router and compressor weights; F32 hyper-connection
  (``hc_*``), attention-sink, compressor ``ape`` and router-bias tensors; I64
  ``tid2eid`` hash tables in the ``num_hash_layers`` first layers;
- three DSpark draft stages ``mtp.0..2`` shaped like an uncompressed layer,
  plus ``mtp.0.main_proj`` (FP8, 3*hidden -> hidden), ``mtp.0.main_norm``,
  ``mtp.2.norm``, ``mtp.2.hc_head_*``, the Markov head (two vocab x
  dspark_markov_rank tables) and the confidence head (1 x hidden+rank).
The published figures this must reproduce, also from that tooling: 72,317
tensors, an index ``total_size`` of 166,878,536,440 bytes, 48 shards of
166,886,535,336 bytes in all (shared/reference/deepseek-v4-flash.md). The
difference, 7,998,896 bytes, is the 48 headers. The fixture's compact headers
come out about 0.3% larger than that (the real shards' tensor order and JSON
layout are not known), so its files total a few hundred kB more than the
published figure while the payload matches it exactly. The fixture splits the
tensors in order into 48 shards of about equal size.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

# A copy of shared/reference/deepseek-v4-flash-config.json (the DSpark variant).
CONFIG_PATH = Path(__file__).parents[1] / "fixtures" / "deepseek-v4-flash-config.json"

# The tensor list and the published figures live in the package (dspark plan --published).
from dspark.plan.published import (  # noqa: E402,F401
    _WIDTH,
    PUBLISHED_PAYLOAD_BYTES,
    PUBLISHED_SHARD_BYTES,
    PUBLISHED_SHARD_COUNT,
    PUBLISHED_TENSOR_COUNT,
    dsv4_tensors,
)


def write_header_only_shard(
    path: Path, tensors: list[tuple[str, str, tuple[int, ...]]], header_bytes: int = 0
) -> int:
    """Write the header, leave the data a sparse hole; return the file size.

    header_bytes: pad the JSON with trailing spaces to this length (0: none).
    """
    raw = _header_json(tensors)
    offset = sum(_WIDTH[d] * math.prod(shape) for _, d, shape in tensors)
    if header_bytes:
        if header_bytes < len(raw):
            raise ValueError(f"{path}: header needs {len(raw)} bytes")
        raw += b" " * (header_bytes - len(raw))
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        f.truncate(8 + len(raw) + offset)
    return 8 + len(raw) + offset


def write_dsv4_flash_checkpoint(model_dir: Path) -> Path:
    model_dir.mkdir(parents=True, exist_ok=True)
    cfg = json.loads(CONFIG_PATH.read_text())
    (model_dir / "config.json").write_text(json.dumps(cfg))
    tensors = dsv4_tensors(cfg)
    total = sum(_WIDTH[d] * math.prod(s) for _, d, s in tensors)
    # Split in order into 48 shards of about equal payload.
    shards: list[list] = [[] for _ in range(PUBLISHED_SHARD_COUNT)]
    done = 0
    for item in tensors:
        index = min(done * PUBLISHED_SHARD_COUNT // total, PUBLISHED_SHARD_COUNT - 1)
        shards[index].append(item)
        done += _WIDTH[item[1]] * math.prod(item[2])
    for i, part in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{PUBLISHED_SHARD_COUNT:05d}.safetensors"
        write_header_only_shard(model_dir / name, part)
    return model_dir


def _header_json(tensors: list[tuple[str, str, tuple[int, ...]]]) -> bytes:
    header: dict[str, dict] = {}
    offset = 0
    for name, dtype, shape in tensors:
        n = _WIDTH[dtype] * math.prod(shape)
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    return json.dumps(header, separators=(",", ":")).encode()


def write_tiny_llama(model_dir: Path, with_weights: bool = True) -> Path:
    """The local appliance's tiny Llama (vllm-runtime.md), optionally with a
    header-only BF16 shard holding its real tensor shapes."""
    model_dir.mkdir(parents=True, exist_ok=True)
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 2,
        "vocab_size": 4096,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-05,
        "hidden_act": "silu",
        "torch_dtype": "bfloat16",
    }
    (model_dir / "config.json").write_text(json.dumps(cfg))
    if with_weights:
        h, inter, vocab, kv = 128, 256, 4096, 2 * 32
        tensors = [("model.embed_tokens.weight", "BF16", (vocab, h)),
                   ("model.norm.weight", "BF16", (h,)),
                   ("lm_head.weight", "BF16", (vocab, h))]
        for i in range(2):
            p = f"model.layers.{i}"
            tensors += [
                (f"{p}.input_layernorm.weight", "BF16", (h,)),
                (f"{p}.post_attention_layernorm.weight", "BF16", (h,)),
                (f"{p}.self_attn.q_proj.weight", "BF16", (h, h)),
                (f"{p}.self_attn.k_proj.weight", "BF16", (kv, h)),
                (f"{p}.self_attn.v_proj.weight", "BF16", (kv, h)),
                (f"{p}.self_attn.o_proj.weight", "BF16", (h, h)),
                (f"{p}.mlp.gate_proj.weight", "BF16", (inter, h)),
                (f"{p}.mlp.up_proj.weight", "BF16", (inter, h)),
                (f"{p}.mlp.down_proj.weight", "BF16", (h, inter)),
            ]
        write_header_only_shard(model_dir / "model.safetensors", tensors)
    return model_dir
