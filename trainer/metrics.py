"""Model FLOPs utilisation (MFU), counted as PaLM does (Chowdhery et al., 2022, app. B)."""

from __future__ import annotations

from infra.capacity import palm_flops_per_token
from trainer.model import GPTConfig


def flops_per_token(config: GPTConfig, non_embedding_params: int) -> float:
    """6N for the matmuls of forward and backward, plus 12·L·H·Q·T for attention scores: the
    planner's figure (infra.capacity), so plans and measured MFU agree."""
    return palm_flops_per_token(
        non_embedding_params, config.n_layer, config.n_embd, config.block_size
    )


def mfu(
    tokens_per_s: float, flops_per_tok: float, peak_flops_per_device: float, devices: int
) -> float:
    return tokens_per_s * flops_per_tok / (peak_flops_per_device * devices)
