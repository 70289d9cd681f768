"""Held-out loss, perplexity and a text sample from a committed checkpoint, in one process."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer

from trainer.checkpoint import load_model_weights
from trainer.data import TokenStream, sequential_batches
from trainer.model import GPT, GPTConfig


@dataclass(frozen=True)
class Evaluation:
    val_loss: float
    perplexity: float
    val_tokens: int  # tokens actually scored
    sample: str


def load_model(checkpoint_folder: Path, model_config: dict) -> GPT:
    model = GPT(GPTConfig(**model_config))
    load_model_weights(model, checkpoint_folder)
    return model.eval()


@torch.no_grad()
def held_out_loss(
    model: GPT, stream: TokenStream, batch_size: int, max_batches: int
) -> tuple[float, int]:
    """Mean next-token loss over non-overlapping validation windows, weighted by tokens."""
    total, tokens = 0.0, 0
    for x, y in sequential_batches(stream, batch_size, max_batches):
        _, loss = model(x, y)
        total += loss.item() * y.numel()
        tokens += y.numel()
    return total / tokens, tokens


def sample_text(
    model: GPT, tokenizer: Tokenizer, prompt: str, max_new_tokens: int, seed: int = 0
) -> str:
    ids = tokenizer.encode(prompt).ids or [0]  # an empty prompt starts from end-of-document
    idx = torch.tensor([ids], dtype=torch.long)
    generator = torch.Generator().manual_seed(seed)
    out = model.generate(idx, max_new_tokens, generator=generator)
    # Keep special tokens: a visible <|endoftext|> shows where the model ended a document.
    return tokenizer.decode(out[0].tolist(), skip_special_tokens=False)


def evaluate_checkpoint(
    *,
    checkpoint_folder: Path,
    model_config: dict,
    val_shards: list[Path],
    dtype: str,
    tokenizer_file: Path,
    batch_size: int,
    max_batches: int,
    prompt: str,
    sample_tokens: int,
    seed: int,
) -> Evaluation:
    model = load_model(checkpoint_folder, model_config)
    stream = TokenStream(val_shards, dtype, model.config.block_size)
    loss, tokens = held_out_loss(model, stream, batch_size, max_batches)
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    sample = sample_text(model, tokenizer, prompt, sample_tokens, seed)
    return Evaluation(val_loss=loss, perplexity=math.exp(loss), val_tokens=tokens, sample=sample)
