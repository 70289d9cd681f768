"""A baseline network for bench/trainer.py only: the built-in GPT's shape with one plain fused
qkv projection (q, then k, then v, nanoGPT's `c_attn`) and no biases (`bias=False`), to
measure what the built-in GPT's own layout costs: its qkv rows are grouped by head so that
tensor parallelism can shard whole heads (and it had separate q, k, v with biases before).

It is the built-in GPT (same embeddings, MLP, tied head, initialisation and forward) with each
block's attention replaced by this one and every bias removed, so the two differ in exactly
that. Only the benchmark's shape is supported: learned positions, GELU MLP.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from trainer.model import GPT, GPTConfig


class FusedAttention(nn.Module):
    """Causal self-attention with q, k and v from one (C, 3C) matrix, no biases."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_embd, self.head_dim = config.n_embd, config.n_embd // config.n_head
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd, bias=False)
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=False)
        nn.init.normal_(self.qkv.weight, mean=0.0, std=0.02)
        nn.init.normal_(self.proj.weight, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = (
            t.view(B, T, -1, self.head_dim).transpose(1, 2)
            for t in self.qkv(x).split(self.n_embd, dim=2)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).contiguous().view(B, T, C))


def fused_gpt(config: GPTConfig) -> GPT:
    if config.rope or config.swiglu or config.dropout:
        raise ValueError("the fused baseline has learned positions, GELU and no dropout only")
    model = GPT(config)
    for block in model.blocks:
        block.attn = FusedAttention(config)
    for module in model.modules():
        if isinstance(module, nn.Linear | nn.LayerNorm):
            module.bias = None
    return model
