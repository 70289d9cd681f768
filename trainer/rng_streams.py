"""Where a training step's randomness (dropout) comes from, so that every layout draws what it
must and a resumed run draws what an uninterrupted one would.

Two streams, both seeded again at every step from (seed, step, coordinates), so there is no
generator state to checkpoint:

- the default stream (torch's default generator), seeded by the rank's *data-parallel*
  coordinate. The ranks of a tensor-parallel group hold the same residual stream (the
  row-parallel projections all-reduce it); drawn from a stream per rank, their dropout masks on
  it would differ and their copies of the activations, then of the replicated weights (norms,
  embeddings), drift apart. Seeded alike, they stay identical.
- the sharded stream, seeded by the global rank, for what each tensor-parallel rank holds alone:
  attention dropout on its own heads. Drawn from the default stream, head h of rank 0 and head
  h of rank 1 would get the same mask. The model draws from it inside `sharded_draws()`, which
  swaps its generator state in and out (as Megatron-LM's RNG tracker does).

Without tensor parallelism the data-parallel coordinate is the rank, so the default stream is
seeded as it always was: runs recorded before this module resume as they did.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

# Seeds of consecutive steps lie this far apart, more than any gang's ranks, so no two
# (step, rank) pairs share a seed.
STEP_STRIDE = 1_000_003
# The sharded stream's seeds sit above every default-stream seed of a run.
_SHARDED_OFFSET = 1 << 40


def step_seed(seed: int, step: int, coordinate: int) -> int:
    """The seed of `step` (counted from 1) for a rank at `coordinate`."""
    return seed + STEP_STRIDE * step + coordinate


class _ShardedStream:
    """A generator state of its own on the rank's device, swapped with the default one while
    the model draws for a tensor-parallel shard."""

    def __init__(self) -> None:
        self.device: torch.device | None = None
        self.state: torch.Tensor | None = None

    def reseed(self, device: torch.device, seed: int) -> None:
        self.device = device
        with _swapped_in(device, None):
            if device.type == "cpu":
                torch.default_generator.manual_seed(seed)
            else:
                torch.cuda.manual_seed(seed)
            self.state = _get_state(device)


_SHARDED = _ShardedStream()


def seed_step(
    device: torch.device, seed: int, step: int, dp_rank: int, rank: int, tensor_parallel: bool
) -> None:
    """Seed the default stream for `step` by the data-parallel coordinate and, under tensor
    parallelism, the sharded one by the global rank. On CPU only the CPU generator:
    torch.manual_seed would also queue a seed for CUDA, which formats the Python stack each
    time (a few hundred microseconds a step) for a device never used."""
    value = step_seed(seed, step, dp_rank)
    if device.type == "cpu":
        torch.default_generator.manual_seed(value)
    else:
        torch.manual_seed(value)
    if tensor_parallel:
        _SHARDED.reseed(device, _SHARDED_OFFSET + step_seed(seed, step, rank))


@contextlib.contextmanager
def sharded_draws() -> Iterator[None]:
    """Draw from the sharded stream inside; the default stream continues after as if nothing
    had been drawn. Outside a step seeded by `seed_step` (a plain forward pass, evaluation),
    the default stream is used."""
    stream = _SHARDED
    if stream.device is None or stream.state is None:
        yield
        return
    with _swapped_in(stream.device, stream.state):
        try:
            yield
        finally:
            stream.state = _get_state(stream.device)


class ShardedReplay:
    """The sharded stream for a block whose activations are recomputed in backward
    (`trainer.activation_recompute`): torch's checkpoint keeps the default stream's state and
    draws again from it, but it does not know the sharded one, which has moved on to later
    blocks by the time this block is recomputed. `noted()` wraps the forward and keeps the
    state it started from; `replayed()` wraps the recompute, draws from that state again and
    leaves the stream where the step has it."""

    def __init__(self) -> None:
        self._state: torch.Tensor | None = None

    @contextlib.contextmanager
    def noted(self) -> Iterator[None]:
        # sharded_draws replaces the state with a new tensor after each draw, never writes it
        # in place: holding the reference keeps this moment's state.
        self._state = _SHARDED.state
        yield

    @contextlib.contextmanager
    def replayed(self) -> Iterator[None]:
        current = _SHARDED.state
        _SHARDED.state = self._state
        try:
            yield
        finally:
            _SHARDED.state = current


@contextlib.contextmanager
def forked(device: torch.device) -> Iterator[None]:
    """Draw inside (after seeding anew with `seed_step`) and leave both streams afterwards as
    they were: a recompute of another rank's step draws that rank's masks, and this rank's
    own step continues as if nothing had been drawn."""
    sharded = (_SHARDED.device, _SHARDED.state)
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            yield
    finally:
        _SHARDED.device, _SHARDED.state = sharded


@contextlib.contextmanager
def _swapped_in(device: torch.device, state: torch.Tensor | None) -> Iterator[None]:
    """Run with `state` as the device's generator state (None: as it is), then put the
    previous state back."""
    saved = _get_state(device)
    if state is not None:
        _set_state(device, state)
    try:
        yield
    finally:
        _set_state(device, saved)


def _get_state(device: torch.device) -> torch.Tensor:
    if device.type == "cpu":
        return torch.default_generator.get_state()
    return torch.cuda.get_rng_state(device)


def _set_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cpu":
        torch.default_generator.set_state(state)
    else:
        torch.cuda.set_rng_state(state, device)
