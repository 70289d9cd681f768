"""Whose gradients went bad: each data-parallel replica's gradient norm *before* the all-reduce.

After the all-reduce every replica holds the same average, and a NaN or a flipped exponent bit
from one rank has spread to all of them: only the norm before says whose it was. A DDP
communication hook sees each bucket of this rank's gradients just before it is sent; it adds up
their squares and then reduces the bucket exactly as DDP would without a hook. FSDP's
reduce-scatter is watched alike (trainer.shard_watch).

`forgeline chaos corrupt-grad` poisons a bucket here, before the all-reduce, as a bit flip in a
GPU's memory would: the whole gang then sees NaN, and only this evidence names the rank. With
`--finite --scale S` it multiplies the bucket by S instead, as a device that is wrong rather than
dead would: no NaN, and only the suspect watch (`trainer.spike_watch`) can see it.
"""

# No `from __future__ import annotations` here: DDP checks the hook's annotations as objects.
import contextlib
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from statistics import median

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

from trainer.shadow_check import Fingerprint, fingerprint, gradient_summary, recompute

# A replica's norm this many times the others' median is not a different batch: it is suspect.
OUTLIER_FACTOR = 100.0


class OwnGradients(ABC):
    """What this rank computed itself, seen just before the reduction mixes it with the others':
    its norm each step, the chaos poison, and on a shadow-checked step the first micro-batch's
    gradient summaries (trainer.shadow_check). A layout's subclass says where it sees them (DDP:
    an all-reduce hook; FSDP: a reduce-scatter of its own, trainer.shard_watch) and how a
    micro-batch is computed again for a check."""

    # Whether a recompute is a collective: every rank of the gang must run one at once.
    collective = False

    def __init__(
        self,
        poison_now: Callable[[], float | None] = lambda: None,
        micro_now: Callable[[], int] = lambda: 1,
    ) -> None:
        self.poison_now = poison_now  # chaos: poison this rank's next buffer, once (`poison`)
        self.micro_now = micro_now  # the step's micro-batch being computed, from 1
        # This step's sum of squares so far, a float64 tensor on the buffers' own device (None:
        # nothing reduced yet). Never copied to the host in a hook: a copy there would block the
        # backward for every bucket until the device catches up, and the reduction could no
        # longer overlap the rest of the backward. `take` reads it once a step.
        self._squares: torch.Tensor | None = None
        # On a shadow-checked step: each piece's gradient summary from the step's first
        # backward, key -> (sum, sum of squares) (trainer.shadow_check).
        self._first: dict[int, torch.Tensor] | None = None
        self._first_micro: int | None = None  # the micro-batch of the first one kept

    def _seen(
        self, buffer: torch.Tensor, pieces: Callable[[], Iterable[tuple[int, torch.Tensor]]]
    ) -> None:
        """A buffer of this rank's own gradients about to be reduced; `pieces`: its parts by
        key, for the shadow checks' record."""
        if (scale := self.poison_now()) is not None:
            poison(buffer, scale)
        squares = buffer.detach().double().pow(2).sum()
        # The first bucket's sum is the accumulator itself: 0.0 + x is x bit for bit, so the
        # norm is what a host accumulator starting at zero gave.
        self._squares = squares if self._squares is None else self._squares.add_(squares)
        if self._first is not None:  # the first micro-batch's wins: later ones hold sums
            if self._first_micro is None:
                self._first_micro = self.micro_now()
            for key, grad in pieces():
                self._first.setdefault(key, gradient_summary(grad))

    def record_first(self) -> None:
        """Keep this step's first backward's gradients' summaries (a shadow-checked step)."""
        self._first, self._first_micro = {}, None

    def _first_in(self, keys: Iterable[int]) -> tuple[Fingerprint, int]:
        first, self._first = self._first or {}, None
        found = fingerprint(first.get(key, gradient_summary(None)) for key in keys)
        return found, self._first_micro or 0

    @abstractmethod
    def first_fingerprint(self, module: torch.nn.Module) -> tuple[Fingerprint, int]:
        """The fingerprint of the first reduced gradients' own values, as `record_first` kept
        them, and the micro-batch they came from (0: none came: nothing was reduced); stops
        recording. A loop that accumulates without syncing reduces first after its last
        micro-batch, holding their sum."""

    @abstractmethod
    def recompute(self, module: torch.nn.Module, loss: Callable[[], torch.Tensor]) -> Fingerprint:
        """The fingerprint of one micro-batch computed again (`loss()` computes its loss with
        `module`), alike to `first_fingerprint`'s, leaving the step's own gradients as they
        are."""

    def take(self) -> float:
        """This step's norm of the gradients this rank computed itself; resets for the next.
        The one read of the accumulator a step (a device sync on a GPU), where the step's
        signals are read (`Step.gradients`), after the backward has queued every bucket."""
        squares, self._squares = self._squares, None
        return 0.0 if squares is None else math.sqrt(float(squares))


class PreReduceNorms(OwnGradients):
    """DDP: a communication hook sees each bucket of this rank's gradients just before it is
    all-reduced, and then reduces it exactly as DDP would without a hook."""

    def __init__(
        self,
        model: DistributedDataParallel,
        group: dist.ProcessGroup,
        poison_now: Callable[[], float | None] = lambda: None,
        micro_now: Callable[[], int] = lambda: 1,
    ) -> None:
        super().__init__(poison_now, micro_now)
        self.group = group
        self._dry = False  # pass buckets back unreduced and unseen (trainer.ddp_buckets)
        model.register_comm_hook(self, PreReduceNorms._hook)

    @contextlib.contextmanager
    def dry(self) -> Iterator[None]:
        self._dry = True
        try:
            yield
        finally:
            self._dry = False

    @staticmethod
    def _hook(
        state: "PreReduceNorms", bucket: dist.GradBucket
    ) -> torch.futures.Future[torch.Tensor]:
        if state._dry:
            done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
            done.set_result(bucket.buffer())
            return done
        pieces = zip(bucket.parameters(), bucket.gradients(), strict=True)
        state._seen(bucket.buffer(), lambda: ((id(param), grad) for param, grad in pieces))
        return allreduce_hook(state.group, bucket)

    def first_fingerprint(self, module: torch.nn.Module) -> tuple[Fingerprint, int]:
        return self._first_in(id(p) for p in module.parameters() if p.requires_grad)

    def recompute(self, module: torch.nn.Module, loss: Callable[[], torch.Tensor]) -> Fingerprint:
        """By autograd alone: no `.grad` touched, no collective (the module is DDP's own)."""
        return recompute(module, loss)


def suspects(norms: list[float]) -> list[int]:
    """Ranks whose own gradients were non-finite while others' were fine, or (with three or
    more replicas, so a majority can say what is normal) far above the others' median. Empty
    when every rank is alike: a diverging run is not a broken machine."""
    broken = [rank for rank, norm in enumerate(norms) if not math.isfinite(norm)]
    if broken:
        return broken if len(broken) < len(norms) else []
    if len(norms) < 3:
        return []
    return [
        rank
        for rank, norm in enumerate(norms)
        if norm > OUTLIER_FACTOR * median(norms[:rank] + norms[rank + 1 :])
    ]


def chaos_order(chaos_file: Path | None, step: int, fault: str) -> list[str] | None:
    """`forgeline chaos` wrote its file (`FAULT STEP [ARGS]`): this fault's words once it is
    due, and the file is gone (the fault strikes once). The step (`--at-step`) lets a test aim
    between two checkpoints however fast the model trains; 0: at once."""
    if chaos_file is None:
        return None
    try:
        words = chaos_file.read_text().split()
    except FileNotFoundError:
        return None
    if not words or words[0] != fault or (len(words) > 1 and step < int(words[1])):
        return None
    chaos_file.unlink(missing_ok=True)
    return words


def chaos_poison(chaos_file: Path | None, step: int) -> float | None:
    """`forgeline chaos corrupt-grad`: poison this rank's gradients once, so detection and
    rollback can be seen working. None: not now; NaN: a NaN, as a flipped exponent bit in a
    GPU's memory would make; a number: scale them by it (`--finite`)."""
    words = chaos_order(chaos_file, step, "corrupt-grad")
    if words is None:
        return None
    return float(words[2]) if len(words) > 2 else math.nan


class ChaosPoison:
    """`forgeline chaos corrupt-grad` on this rank, as `OwnGradients.poison_now`: the scale for
    the buffer being reduced now. Every buffer of the first micro-batch of the step the order
    is due at (each DDP bucket, each FSDP block), so the whole of this rank's gradients of that
    micro-batch are off alike; the order is read once, and gone."""

    def __init__(
        self, chaos_file: Path | None, step_now: Callable[[], int], micro_now: Callable[[], int]
    ) -> None:
        self.chaos_file = chaos_file
        self.step_now = step_now
        self.micro_now = micro_now
        # The step the file was last read for, and the scale it gave (None: no order): read
        # once a step, not once for every buffer reduced.
        self._read: tuple[int, float | None] | None = None

    def __call__(self) -> float | None:
        step = self.step_now()
        if self._read is None or self._read[0] != step:
            self._read = (step, chaos_poison(self.chaos_file, step))
        scale = self._read[1]
        return scale if scale is not None and self.micro_now() <= 1 else None


def flip_low_bit(model: torch.nn.Module) -> None:
    """`forgeline chaos flip-bit`: the lowest mantissa bit of this rank's first parameter's
    first element flips, as one bad bit in a device's memory would: a finite, tiny error that
    stays in this rank's copy of the weights and in everything computed from it."""
    param = next(model.parameters())
    local = param.to_local() if hasattr(param, "to_local") else param
    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[local.element_size()]
    with torch.no_grad():
        local.data.view(-1)[:1].view(bits).bitwise_xor_(1)


def poison(gradients: torch.Tensor, scale: float) -> None:
    """NaN into the first element, or every element times `scale` (a finite corruption)."""
    with torch.no_grad():
        if math.isnan(scale):
            gradients.view(-1)[0] = float("nan")
        else:
            gradients.mul_(scale)


def corrupt_gradients(model: torch.nn.Module, scale: float) -> None:
    """The poison for a model with no reduction of its own to watch (tensor parallel): after
    backward, on the first gradient this rank holds (its shard)."""
    grad = next(p.grad for p in model.parameters() if p.grad is not None)
    poison(grad.to_local() if hasattr(grad, "to_local") else grad, scale)
