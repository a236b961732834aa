"""The vision tower of DeepSeek's multimodal checkpoints, tensor by tensor: the ViT, the aligner
that maps its merged patches into the language model's hidden size, and the learned image
vectors. DeepSeek-V4-Flash-Vision-Exp and DeepSeek-V4.1-Flash carry the same tower
(vLLM 0.32.0 builds both with ``models/deepseek_v4/common/vision.py``).

Names, dtypes and shapes as Vision-Exp's shard 1 holds them (every tensor BF16; the header
manifest of revision 86f746b pinned by mudler/vllm.cpp,
``tests/parity/goldens/deepseek_v4_vision/shard1_header_manifest.json``); V4.1's tower has the
same names (ISEEKYAN/Megatron-LM, ``experimental/lite/docs/contracts/deepseek_v41/weights.json``)
and no ``image_pad``. No V4.1 header was found: its dtypes and shapes are these rules at its own
hidden size, and the V4.1 description they are part of reproduces its index exactly
(published_v41.py).

Which of them each tensor-parallel rank holds whole, in vLLM 0.32.0 (``vision.py``) at its default
``--mm-encoder-tp-mode weights``: the patch embedding (``ReplicatedLinear``), the RMSNorms, the
row-parallel layers' biases and the image vectors (``vl_model.py``: float32 parameters); wqkv,
w1 (column-parallel), wo, w2 (row-parallel) and the aligner's weights are split. With
``--mm-encoder-tp-mode data``, or a tensor-parallel size that does not divide the 16 heads, the
whole tower is replicated.
"""

from __future__ import annotations

Tensor = tuple[str, str, tuple[int, ...]]


def vision_tensors(cfg: dict, image_vectors: tuple[str, ...]) -> list[Tensor]:
    """(name, dtype, shape) of the tower's tensors; ``cfg`` is flat (``vision_*`` keys)."""
    h = cfg["hidden_size"]
    d, inter = cfg["vision_dim"], cfg["vision_inter_dim"]
    patch, merge = cfg["vision_patch_size"], cfg["vision_downsample_ratio"]
    out: list[Tensor] = []

    def t(name: str, *shape: int) -> None:
        out.append((name, "BF16", shape))

    t("vision.patch_embed.proj.weight", d, 3 * patch * patch)  # RGB patches, flattened
    t("vision.patch_embed.proj.bias", d)
    for i in range(cfg["vision_n_layers"]):
        p = f"vision.blocks.{i}"
        t(f"{p}.norm1.weight", d)
        t(f"{p}.attn.wqkv.weight", 3 * d, d)
        t(f"{p}.attn.wqkv.bias", 3 * d)
        t(f"{p}.attn.wo.weight", d, d)
        t(f"{p}.attn.wo.bias", d)
        t(f"{p}.norm2.weight", d)
        t(f"{p}.mlp.w1.weight", 2 * inter, d)  # gate and up, fused
        t(f"{p}.mlp.w2.weight", d, inter)
    t("vision.norm.weight", d)
    t("aligner.w1.weight", h, d * merge * merge)  # a merge x merge block of patches
    t("aligner.w1.bias", h)
    t("aligner.w2.weight", h, h)
    t("aligner.w2.bias", h)
    for name in image_vectors:
        t(name, h)
    return out


def replicated_by_vllm(name: str) -> bool:
    """Whether vLLM 0.32.0 holds this tower tensor whole on every rank (mm-encoder-tp-mode
    weights); see the module's docstring."""
    return (name.startswith(("vision.patch_embed.", "image_")) or name.endswith(("norm1.weight", "norm2.weight"))
            or name in ("vision.norm.weight", "aligner.w2.bias") or name.endswith(".attn.wo.bias"))
