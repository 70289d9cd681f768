"""Held-out loss, perplexity and a text sample from a committed checkpoint, in one process."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from tokenizers import Tokenizer

from trainer.checkpoint import load_model_weights
from trainer.data import TokenStream, rank_batches
from trainer.model import GPT, GPTConfig
from trainer.sampling import sample_text


@dataclass(frozen=True)
class Evaluation:
    val_loss: float
    perplexity: float
    val_tokens: int  # tokens actually scored
    samples: list[str]  # one continuation per prompt, in the prompts' order


def load_model(checkpoint_folder: Path, model_config: dict) -> GPT:
    model = GPT(GPTConfig(**model_config))
    load_model_weights(model, checkpoint_folder)
    return model.eval()


@torch.no_grad()
def held_out_loss(
    model: torch.nn.Module,
    stream: TokenStream,
    batch_size: int,
    max_batches: int,
    part: tuple[int, int] = (0, 1),
) -> tuple[float, int]:
    """Mean next-token loss over validation samples in order, weighted by tokens.

    With `part = (rank, ranks)` each data-parallel rank scores its share (`rank_batches`) and
    the sums are all-reduced.
    """
    rank, ranks = part
    device = next(model.parameters()).device
    sums = torch.zeros(2, dtype=torch.float64)  # loss × tokens, tokens
    for x, y, counts in rank_batches(stream, batch_size, max_batches, rank, ranks):
        _, loss = model(x.to(device), y.to(device))
        if counts:
            sums += torch.tensor([loss.item() * y.numel(), y.numel()], dtype=torch.float64)
    if ranks > 1:
        dist.all_reduce(sums)
    return float(sums[0] / sums[1]), int(sums[1])


def evaluate_checkpoint(
    *,
    checkpoint_folder: Path,
    model_config: dict,
    val_shards: list[Path],
    dtype: str,
    tokenizer_file: Path,
    batch_size: int,
    max_batches: int,
    prompts: list[str],
    sample_tokens: int,
    seed: int,
) -> Evaluation:
    model = load_model(checkpoint_folder, model_config)
    stream = TokenStream(val_shards, dtype, model.config.block_size)
    loss, tokens = held_out_loss(model, stream, batch_size, max_batches)
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    samples = [sample_text(model, tokenizer, prompt, sample_tokens, seed) for prompt in prompts]
    return Evaluation(val_loss=loss, perplexity=math.exp(loss), val_tokens=tokens, samples=samples)


def checkpoint_val_loss(
    checkpoint_folder: Path,
    model_config: dict,
    val_shards: list[Path],
    dtype: str,
    batch_size: int,
    max_batches: int,
) -> float:
    """The held-out loss of one checkpoint: a point of the run's val-loss curve."""
    model = load_model(checkpoint_folder, model_config)
    stream = TokenStream(val_shards, dtype, model.config.block_size)
    return held_out_loss(model, stream, batch_size, max_batches)[0]
