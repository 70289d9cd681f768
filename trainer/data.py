"""Deterministic samples from memory-mapped token shards.

A sample is a window of block_size + 1 tokens (inputs and shifted targets) starting at a multiple
of block_size inside one shard, so every token is a target at most once per epoch. Sample order is
a pseudo-random permutation keyed by (seed, epoch), computed per index (a Feistel network), so it
costs no memory whatever the corpus size. The data cursor is one number, the samples consumed by
all ranks together: step s reads global positions [cursor, cursor + global_batch) and each
data-parallel rank keeps its own contiguous slice. The global batch therefore does not depend on
how many ranks share it, and a resume with a different data-parallel size neither skips nor
repeats a sample.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from trainer.errors import DataError

_ROUNDS = 4
# Positions whose sample order is computed at once. The Feistel rounds cost numpy's per-call
# overhead, not per element: a batch of 12 took 0.4 ms a step (1.6 % of a small model's step),
# a block of 4,096 takes about as long once per 4,096 samples.
ORDER_BLOCK = 4096
_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)


class TokenStream:
    """The shards of one split, read through memory maps (nothing is loaded up front)."""

    def __init__(self, paths: list[Path], dtype: str, block_size: int) -> None:
        self.block_size = block_size
        self.shards = [np.memmap(p, dtype=np.dtype(dtype), mode="r") for p in paths]
        per_shard = [max(0, (len(s) - 1) // block_size) for s in self.shards]
        self._starts = np.cumsum([0, *per_shard]).tolist()
        self.samples = self._starts[-1]
        self.tokens = sum(len(s) for s in self.shards)
        if self.samples == 0:
            raise DataError(
                f"{self.tokens} tokens in {len(paths)} shard(s) cannot fill one sample of "
                f"block_size + 1 = {block_size + 1} tokens: lower model.block_size or add data"
            )

    def sample(self, index: int) -> np.ndarray:
        shard = bisect.bisect_right(self._starts, index) - 1
        offset = (index - self._starts[shard]) * self.block_size
        return np.asarray(self.shards[shard][offset : offset + self.block_size + 1], dtype=np.int64)

    def batch(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        windows = torch.from_numpy(np.stack([self.sample(int(i)) for i in indices]))
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()  # (B, T) each


def _mix(values: np.ndarray, key: np.uint64) -> np.ndarray:
    """splitmix64's finaliser over (value ^ key): a cheap keyed hash for the Feistel rounds."""
    z = (values ^ key) & _MASK64
    z = (z + np.uint64(0x9E3779B97F4A7C15)) & _MASK64
    z = ((z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)) & _MASK64
    z = ((z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)) & _MASK64
    return z ^ (z >> np.uint64(31))


class SampleOrder:
    """A bijection of [0, n) per epoch, keyed by (seed, epoch): position → sample index."""

    def __init__(self, n: int, seed: int) -> None:
        if n < 1:
            raise ValueError("a sample order needs at least one sample")
        self.n = n
        self.seed = seed
        self._half_bits = max(1, (max(n - 1, 1).bit_length() + 1) // 2)

    def _keys(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).integers(
            0, 2**63, size=_ROUNDS, dtype=np.uint64
        )

    def _permute_once(self, x: np.ndarray, keys: np.ndarray) -> np.ndarray:
        half = np.uint64(self._half_bits)
        low_mask = np.uint64((1 << self._half_bits) - 1)
        left, right = x >> half, x & low_mask
        for key in keys:
            left, right = right, left ^ (_mix(right, key) & low_mask)
        return (left << half) | right

    def indices(self, epoch: int, positions: np.ndarray) -> np.ndarray:
        """The sample index at each position of `epoch`'s order."""
        keys = self._keys(epoch)
        x = positions.astype(np.uint64)
        # Cycle-walking: the Feistel domain is the next even power of two ≥ n (under 4n), so
        # re-encrypting the few values that land outside [0, n) keeps the map a bijection.
        out = self._permute_once(x, keys)
        outside = out >= np.uint64(self.n)
        while outside.any():
            out[outside] = self._permute_once(out[outside], keys)
            outside = out >= np.uint64(self.n)
        return out.astype(np.int64)


@dataclass(frozen=True)
class RankSlice:
    """Which part of each global batch this rank reads."""

    dp_rank: int
    dp_size: int
    micro_batches: int  # gradient accumulation steps


class Sampler:
    """The sample indices of every step, for one data-parallel rank."""

    def __init__(self, stream: TokenStream, seed: int, global_batch: int, part: RankSlice) -> None:
        if global_batch % (part.dp_size * part.micro_batches):
            raise ValueError(
                f"batch_size {global_batch} must be divisible by data-parallel ranks "
                f"({part.dp_size}) × grad_accum_steps ({part.micro_batches})"
            )
        self.stream = stream
        self.order = SampleOrder(stream.samples, seed)
        self.global_batch = global_batch
        self.part = part
        self._blocks: dict[int, np.ndarray] = {}  # block number -> its sample indices

    def global_indices(self, cursor: int) -> np.ndarray:
        """The samples of the global batch that starts at `cursor` (all ranks together)."""
        first, last = cursor // ORDER_BLOCK, (cursor + self.global_batch - 1) // ORDER_BLOCK
        # The blocks this batch needs, reusing those already computed; the others are dropped.
        self._blocks = {
            k: self._blocks[k] if k in self._blocks else self._order_of(k)
            for k in range(first, last + 1)
        }
        # A copy, never a view of a kept block: a caller that changes it cannot change the order.
        joined = np.concatenate(list(self._blocks.values()))
        start = cursor - first * ORDER_BLOCK
        return joined[start : start + self.global_batch]

    def _order_of(self, block: int) -> np.ndarray:
        """The sample indices at the positions of one block (which may straddle epochs)."""
        positions = np.arange(block * ORDER_BLOCK, (block + 1) * ORDER_BLOCK, dtype=np.int64)
        epochs = positions // self.order.n
        out = np.empty_like(positions)
        for epoch in np.unique(epochs):
            mine = epochs == epoch
            out[mine] = self.order.indices(int(epoch), positions[mine] % self.order.n)
        return out

    def rank_indices(self, cursor: int, dp_rank: int | None = None) -> np.ndarray:
        """The samples of one data-parallel rank (this sampler's own by default)."""
        per_rank = self.global_batch // self.part.dp_size
        start = (self.part.dp_rank if dp_rank is None else dp_rank) * per_rank
        return self.global_indices(cursor)[start : start + per_rank]

    def first_micro_batch(self, cursor: int, dp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y) of another data-parallel rank's first micro-batch: what a shadow check
        recomputes (trainer.shadow_check)."""
        chunk = np.array_split(self.rank_indices(cursor, dp_rank), self.part.micro_batches)[0]
        return self.stream.batch(chunk)

    def micro_batches(self, cursor: int) -> Iterator[tuple[np.ndarray, torch.Tensor, torch.Tensor]]:
        """(sample indices, x, y) for each gradient-accumulation micro-batch of this rank."""
        mine = self.rank_indices(cursor)
        for chunk in np.array_split(mine, self.part.micro_batches):
            x, y = self.stream.batch(chunk)
            yield chunk, x, y

    def epoch(self, cursor: int) -> int:
        return cursor // self.order.n


def to_device(batch: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A batch onto the run's device. On a GPU it goes from page-locked memory without waiting:
    a copy from pageable memory makes torch synchronize the stream after it, so a step's second
    micro-batch would wait for the first one's backward, and the host could not queue ahead.
    torch's pinned allocator keeps the host block until the copy is done, so it may be dropped
    at once."""
    if device.type != "cuda":
        return batch.to(device)
    return batch.pin_memory().to(device, non_blocking=True)


def _evaluation_windows(stream: TokenStream, batch_size: int, max_batches: int) -> list[np.ndarray]:
    count = min(stream.samples, batch_size * max_batches)
    return [np.arange(s, min(s + batch_size, count)) for s in range(0, count, batch_size)]


def sequential_batches(
    stream: TokenStream, batch_size: int, max_batches: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Samples in order, for evaluation: every token is scored at most once."""
    for indices in _evaluation_windows(stream, batch_size, max_batches):
        yield stream.batch(indices)


def rank_batches(
    stream: TokenStream, batch_size: int, max_batches: int, rank: int, ranks: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor, bool]]:
    """This data-parallel rank's share of `sequential_batches`, dealt round-robin; only its own
    batches are read. Every rank yields the same number (a sharded model's forward is a
    collective), so a rank short of a batch repeats the first one, flagged False (padding)."""
    windows = _evaluation_windows(stream, batch_size, max_batches)
    for i in range(-(-len(windows) // ranks)):
        j = rank + i * ranks
        x, y = stream.batch(windows[j] if j < len(windows) else windows[0])
        yield x, y, j < len(windows)
