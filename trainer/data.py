"""Deterministic batches from memory-mapped token shards.

The batch of a step is a pure function of (seed, step): every data-parallel rank draws the same
global batch and keeps its own slice. So the data cursor is the step itself, a resumed run sees
exactly the batches it would have seen, and the global batch does not depend on the world size.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from trainer.errors import DataError


class TokenStream:
    """The shards of one split, read through memory maps (nothing is loaded up front)."""

    def __init__(self, paths: list[Path], dtype: str, block_size: int) -> None:
        self.block_size = block_size
        self.shards = [np.memmap(p, dtype=np.dtype(dtype), mode="r") for p in paths]
        # A window is block_size + 1 tokens (inputs and shifted targets) inside one shard.
        per_shard = [max(0, len(s) - block_size) for s in self.shards]
        self._starts = np.cumsum([0, *per_shard]).tolist()
        self.windows = self._starts[-1]
        self.tokens = sum(len(s) for s in self.shards)
        if self.windows == 0:
            raise DataError(
                f"{self.tokens} tokens in {len(paths)} shard(s) cannot fill one window of "
                f"block_size + 1 = {block_size + 1} tokens: lower model.block_size or add data"
            )

    def window(self, index: int) -> np.ndarray:
        shard = bisect.bisect_right(self._starts, index) - 1
        offset = index - self._starts[shard]
        return np.asarray(self.shards[shard][offset : offset + self.block_size + 1], dtype=np.int64)

    def batch(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        windows = torch.from_numpy(np.stack([self.window(int(i)) for i in indices]))
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()  # (B, T) each


def step_batch(
    stream: TokenStream, seed: int, step: int, global_batch: int, rank: int, world: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's slice of the global batch of `step`."""
    rng = np.random.default_rng([seed, step])
    indices = rng.integers(0, stream.windows, size=global_batch)
    per_rank = global_batch // world
    return stream.batch(indices[rank * per_rank : (rank + 1) * per_rank])


def sequential_batches(
    stream: TokenStream, batch_size: int, max_batches: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Non-overlapping windows in order, for evaluation: every token is scored at most once."""
    indices = np.arange(0, stream.windows, stream.block_size)
    for start in range(0, min(len(indices), batch_size * max_batches), batch_size):
        yield stream.batch(indices[start : start + batch_size])
