"""Held-out loss, perplexity and a text sample from a committed checkpoint, in one process;
and the held-out loss a training loop measures between its steps.

Both score on the model's device under the training runtime's precision (bf16 autocast on
GPUs, `trainer.runtime.Runtime.autocast`), so a checkpoint's loss is measured as it trained.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from tokenizers import Tokenizer

from forgeline.shadow import plain_module
from trainer.checkpoint import load_model_weights
from trainer.data import TokenStream, rank_batches
from trainer.model import GPT, GPTConfig
from trainer.runtime import autocast_for
from trainer.sampling import default_device, sample_text

Autocast = Callable[[], AbstractContextManager]


@dataclass(frozen=True)
class Evaluation:
    val_loss: float
    perplexity: float
    val_tokens: int  # tokens actually scored
    samples: list[str]  # one continuation per prompt, in the prompts' order


def load_model(
    checkpoint_folder: Path, model_config: dict, device: torch.device | str = "cpu"
) -> GPT:
    model = GPT(GPTConfig(**model_config))
    load_model_weights(model, checkpoint_folder)
    return model.to(device).eval()


def autocast_on(device: torch.device) -> Autocast:
    """The training runtime's precision on `device` (trainer.runtime.autocast_for), for a
    process that is no rank (the control worker's evaluation)."""
    return functools.partial(autocast_for, device)


@torch.no_grad()
def held_out_loss(
    model: torch.nn.Module,
    stream: TokenStream,
    batch_size: int,
    max_batches: int,
    part: tuple[int, int] = (0, 1),
    autocast: Autocast = contextlib.nullcontext,
) -> tuple[float, int]:
    """Mean next-token loss over validation samples in order, weighted by tokens.

    With `part = (rank, ranks)` each data-parallel rank scores its share (`rank_batches`) and
    the sums are all-reduced. The sums stay on the model's device (float64), so a GPU is read
    once at the end, not once a batch.
    """
    rank, ranks = part
    device = next(model.parameters()).device
    sums = torch.zeros(2, dtype=torch.float64, device=device)  # loss × tokens, tokens
    for x, y, counts in rank_batches(stream, batch_size, max_batches, rank, ranks):
        with autocast():
            _, loss = model(x.to(device), y.to(device))
        if counts:
            # float64 loss × tokens: the same rounding as the host sum this replaced.
            sums[0] += loss.detach().double() * y.numel()
            sums[1] += y.numel()
    if ranks > 1:
        dist.all_reduce(sums)
        # Ranks that share a data-parallel rank (tensor-parallel, pipeline) scored the same
        # share: each counted once.
        sums /= dist.get_world_size() // ranks
    return float(sums[0] / sums[1]), int(sums[1])


def held_out_loss_while_training(
    wrapped: torch.nn.Module,
    stream: TokenStream,
    batch_size: int,
    max_batches: int,
    part: tuple[int, int],
    autocast: Autocast,
) -> tuple[float, int]:
    """`held_out_loss` inside a training loop, on the module without torch.compile's and
    DDP's wrappers (`plain_module`; an FSDP model is its own), in eval mode, then back to
    training. Not through the compiled one: eval mode (dropout off) and the short last batch
    would each recompile it, minutes on a large model, long enough for the hang watch; a
    few forward passes in eager cost far less. Eager also takes the short batch as it is,
    so nothing is dropped or padded and every token of the split is scored."""
    module = plain_module(wrapped)
    module.eval()
    try:
        return held_out_loss(module, stream, batch_size, max_batches, part, autocast)
    finally:
        module.train()


def _scored(
    checkpoint_folder: Path,
    model_config: dict,
    val_shards: list[Path],
    dtype: str,
    batch_size: int,
    max_batches: int,
    device: torch.device,
) -> tuple[GPT, float, int]:
    """A checkpoint's model on `device` with its held-out loss and the tokens scored."""
    model = load_model(checkpoint_folder, model_config, device)
    stream = TokenStream(val_shards, dtype, model.config.block_size)
    loss, tokens = held_out_loss(
        model, stream, batch_size, max_batches, autocast=autocast_on(device)
    )
    return model, loss, tokens


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
    device: torch.device | None = None,
) -> Evaluation:
    """On `device`: the GPU when this process sees one, else the CPU, by default."""
    model, loss, tokens = _scored(
        checkpoint_folder, model_config, val_shards, dtype, batch_size, max_batches,
        device or default_device(),
    )  # fmt: skip
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
    device: torch.device | None = None,
) -> float:
    """The held-out loss of one checkpoint: a point of the run's val-loss curve."""
    return _scored(
        checkpoint_folder, model_config, val_shards, dtype, batch_size, max_batches,
        device or default_device(),
    )[1]  # fmt: skip
