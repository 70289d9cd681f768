"""Model FLOPs utilisation (MFU), counted as PaLM does (Chowdhery et al., 2022, app. B)."""

from __future__ import annotations

from trainer.model import GPTConfig


def flops_per_token(config: GPTConfig, non_embedding_params: int) -> float:
    """6N for the matmuls of forward and backward, plus 12·L·H·Q·T for attention scores."""
    head_dim = config.n_embd // config.n_head
    attention = 12 * config.n_layer * config.n_head * head_dim * config.block_size
    return 6 * non_embedding_params + attention


def mfu(
    tokens_per_s: float, flops_per_tok: float, peak_flops_per_device: float, devices: int
) -> float:
    return tokens_per_s * flops_per_tok / (peak_flops_per_device * devices)
