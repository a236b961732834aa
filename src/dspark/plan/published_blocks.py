"""The tensors every DeepSeek V4 layer of a published checkpoint carries, for the derivations of
published.py (V4-Flash, V4-Flash-Vision-Exp) and published_v41.py (V4.1-Flash): the list they fill
and the layer's head (norms, hyper-connections, the attention projections, the router's weight)."""

from __future__ import annotations

import math

from dspark.plan.published_vision import Tensor


class Tensors:
    """(name, dtype, shape) rows, FP8 weights scaled per ``block`` (rows, columns)."""

    def __init__(self, block: tuple[int, int] = (128, 128)):
        self.out: list[Tensor] = []
        self.block = block

    def t(self, name: str, dtype: str, *shape: int) -> None:
        self.out.append((name, dtype, shape))

    def fp8(self, name: str, rows: int, cols: int) -> None:
        self.t(f"{name}.weight", "F8_E4M3", rows, cols)
        self.t(f"{name}.scale", "F8_E8M0", math.ceil(rows / self.block[0]), math.ceil(cols / self.block[1]))

    def mxfp4(self, name: str, rows: int, cols: int) -> None:
        self.t(f"{name}.weight", "I8", rows, cols // 2)
        self.t(f"{name}.scale", "F8_E8M0", rows, math.ceil(cols / 32))

    def layer_head(self, p: str, cfg: dict, experts: int) -> None:
        """Layer ``p``'s norms, hyper-connection mixes, attention projections and router weight."""
        h, hc = cfg["hidden_size"], cfg["hc_mult"]
        hc_mix = (2 + hc) * hc
        heads, head_dim = cfg["num_attention_heads"], cfg["head_dim"]
        q_rank, o_rank, groups = cfg["q_lora_rank"], cfg["o_lora_rank"], cfg["o_groups"]
        self.t(f"{p}.attn_norm.weight", "BF16", h)
        self.t(f"{p}.ffn_norm.weight", "BF16", h)
        for part in ("attn", "ffn"):
            self.t(f"{p}.hc_{part}_fn", "F32", hc_mix, hc * h)
            self.t(f"{p}.hc_{part}_scale", "F32", 3)
            self.t(f"{p}.hc_{part}_base", "F32", hc_mix)
        self.t(f"{p}.attn.q_norm.weight", "BF16", q_rank)
        self.t(f"{p}.attn.kv_norm.weight", "BF16", head_dim)
        self.t(f"{p}.attn.attn_sink", "F32", heads)
        self.fp8(f"{p}.attn.wq_a", q_rank, h)
        self.fp8(f"{p}.attn.wq_b", heads * head_dim, q_rank)
        self.fp8(f"{p}.attn.wkv", head_dim, h)
        self.fp8(f"{p}.attn.wo_a", groups * o_rank, heads * head_dim // groups)
        self.fp8(f"{p}.attn.wo_b", h, groups * o_rank)
        self.t(f"{p}.ffn.gate.weight", "BF16", experts, h)

    def layer_experts(self, p: str, cfg: dict, experts: int) -> None:
        """Layer ``p``'s FP8 shared expert and its ``experts`` MXFP4 routed experts."""
        h, inter = cfg["hidden_size"], cfg["moe_intermediate_size"]
        self.fp8(f"{p}.ffn.shared_experts.w1", inter, h)
        self.fp8(f"{p}.ffn.shared_experts.w3", inter, h)
        self.fp8(f"{p}.ffn.shared_experts.w2", h, inter)
        for e in range(experts):
            self.mxfp4(f"{p}.ffn.experts.{e}.w1", inter, h)
            self.mxfp4(f"{p}.ffn.experts.{e}.w3", inter, h)
            self.mxfp4(f"{p}.ffn.experts.{e}.w2", h, inter)
