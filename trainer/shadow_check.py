"""Shadow recompute: a rank's micro-batch computed again on another node, and the two compared.

A device that is wrong rather than dead gives finite, plausible gradients; a few percent off,
no norm watch sees them (trainer.spike_watch needs about x20). What does see them is doing the
same work twice. Every `every` steps (the spec's `recovery.shadow_every`), each data-parallel
replica also computes the first micro-batch of the replica on the node before it in a ring of
nodes (on one node, the rank before it), from the same parameters (DDP replicas hold the same),
with the same randomness (trainer.rng_streams derives it from the step and the data-parallel
rank), and the gang compares what the owner computed in its real backward (seen in DDP's
all-reduce hook, before the reduction mixed it) with what its checker computed again.

Gradients are compared by a fingerprint: the sum, the sum of magnitudes and the sum of squares
of every gradient, in float64, parameter by parameter in the model's order, so the two sides add
them up alike. Where kernels are deterministic (CPU) the fingerprints agree bitwise on a healthy
gang. On GPUs they do not (SDPA's backward and atomic adds are not bitwise reproducible, and the
owner's gradients come from the compiled model while the recompute runs eagerly), so there the
spec must allow a relative tolerance (`recovery.shadow_rtol`; zero is refused on CUDA). Each
part is compared relative to a scale that does not cancel: the sum against the sum of
magnitudes (a sum of signed gradients can be near zero while the gradients are not, and a
tolerance relative to it would fail every healthy pair), the others against themselves.

Who is wrong: a device that computes wrong makes its own gradients and its recompute of another
rank's disagree, so a rank in two disagreeing pairs is named. Where one pair alone disagrees
(a fault in one of the two computations), a third rank, on a third node where there is one,
computes the owner's micro-batch again and the majority decides. With two ranks there is no
majority: the step is known to be wrong but not by whom, so the gang rolls back to its last
committed checkpoint all the same, blaming no node (forgeline.health_verdicts).

What a check cannot see: a corruption of one step that the all-reduce averaged into every
replica alike leaves nothing to compare once that step is over, so it is caught only on a
checked step. A corrupt parameter, or a device wrong again and again, is caught at the next
checked step.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

# A script's recompute of one micro-batch: (the model's own module, x, y) -> the tensor the script
# calls backward on for that micro-batch (its loss divided by the accumulation steps).
Recompute = Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]

# (sum, sum of magnitudes, sum of squares) of every gradient, in float64
Fingerprint = tuple[float, float, float]
FINGERPRINT_SIZE = 3


@dataclass(frozen=True)
class ShadowSettings:
    """The spec's `[recovery]` `shadow_every` (0: off) and `shadow_rtol`; in the job file as a
    dict (`TrainJob.shadow`)."""

    every: int = 0
    rtol: float = 0.0

    @classmethod
    def from_dict(cls, data: dict) -> ShadowSettings:
        return cls(**data)

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0


def gradient_summary(grad: torch.Tensor | None) -> torch.Tensor:
    """(sum, sum of magnitudes, sum of squares) of one gradient in float64; zeros for a
    parameter without one."""
    if grad is None:
        return torch.zeros(FINGERPRINT_SIZE, dtype=torch.float64)
    flat = grad.detach().to(torch.float64).reshape(-1)
    return torch.stack((flat.sum(), flat.abs().sum(), flat.pow(2).sum())).cpu()


def fingerprint(summaries: Iterable[torch.Tensor]) -> Fingerprint:
    """The parameters' summaries added up in the order given (the model's parameter order)."""
    total = torch.zeros(FINGERPRINT_SIZE, dtype=torch.float64)
    for summary in summaries:
        total += summary
    return float(total[0]), float(total[1]), float(total[2])


def recompute(module: torch.nn.Module, loss: Callable[[], torch.Tensor]) -> Fingerprint:
    """The fingerprint of the gradients of one micro-batch (`loss()` computes it with
    `module`), computed without touching the parameters' `.grad` (the step's own gradients
    stay as they are) or any collective."""
    params = [p for p in module.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss(), params, allow_unused=True)
    return fingerprint(gradient_summary(g) for g in grads)


def agree(a: Fingerprint, b: Fingerprint, rtol: float) -> bool:
    """Bitwise with `rtol` 0; else within `rtol` (see `drift`)."""
    return a == b if rtol == 0 else drift(a, b) <= rtol


def drift(a: Fingerprint, b: Fingerprint) -> float:
    """The smallest relative tolerance at which `a` and `b` agree: each part's difference
    against its scale, the sum's being the sum of magnitudes (it cannot cancel), the others'
    their own."""
    (sum_a, mag_a, sq_a), (sum_b, mag_b, sq_b) = a, b

    def relative(difference: float, scale: float) -> float:
        return difference / scale if scale else (0.0 if difference == 0 else math.inf)

    magnitude = max(mag_a, mag_b)
    return max(
        relative(abs(sum_a - sum_b), magnitude),
        relative(abs(mag_a - mag_b), magnitude),
        relative(abs(sq_a - sq_b), max(sq_a, sq_b)),
    )


@dataclass(frozen=True)
class Ring:
    """Who checks whom: rank r's checker holds the same local rank on the next node. Under
    tensor parallelism (`tensor` consecutive ranks a group) a rank is checked by the rank of
    the same tensor-parallel position in another group: the one that holds the same slice of
    the weights."""

    world: int
    ranks_per_node: int
    tensor: int = 1

    @property
    def stride(self) -> int:
        # Across nodes, the same local rank on the next node (a whole number of tensor groups
        # on); on one node, the next group (the next rank without tensor parallelism).
        across = math.lcm(self.ranks_per_node, self.tensor)
        return across if self.world > across else self.tensor

    def checker_of(self, rank: int) -> int:
        return (rank + self.stride) % self.world

    def target_of(self, rank: int) -> int:
        return (rank - self.stride) % self.world

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def third(self, owner: int, checker: int) -> int:
        """The rank that breaks a tie between `owner` and `checker`: the next after the checker
        in the ring on a node of neither, else the next rank of their tensor position that is
        neither."""
        nodes = {self.node_of(owner), self.node_of(checker)}
        order = [(checker + self.stride * k) % self.world for k in range(1, self.world)]
        order += [(checker + self.tensor * k) % self.world for k in range(1, self.world)]
        others = [r for r in order if r not in (owner, checker)]
        elsewhere = [r for r in others if self.node_of(r) not in nodes]
        return (elsewhere or others)[0]


@dataclass(frozen=True)
class Disagreement:
    """One owner's gradients against its checker's recompute of them."""

    owner: int
    checker: int
    own: Fingerprint
    checked: Fingerprint


def disagreements(
    ring: Ring, own: list[Fingerprint], checked: list[Fingerprint], rtol: float
) -> list[Disagreement]:
    """`own[r]`: rank r's own gradients; `checked[r]`: rank r's recompute of its target's."""
    found = []
    for owner in range(ring.world):
        checker = ring.checker_of(owner)
        mine, theirs = own[owner], checked[checker]
        if not agree(mine, theirs, rtol):
            found.append(Disagreement(owner, checker, mine, theirs))
    return found


def named_by_pairs(found: list[Disagreement]) -> set[int]:
    """Ranks in two or more disagreeing pairs: wrong both in their own work and in a check."""
    count = Counter(r for d in found for r in (d.owner, d.checker))
    return {rank for rank, n in count.items() if n >= 2}


@dataclass(frozen=True)
class Verdict:
    """What a checked step found: the ranks named (empty: nobody could be named) and why."""

    step: int
    ranks: list[int]
    evidence: str


def describe(d: Disagreement) -> str:
    return (
        f"rank {d.owner}'s own gradients ({_parts(d.own)}) differ from rank {d.checker}'s "
        f"recompute of its micro-batch ({_parts(d.checked)})"
    )


def _parts(found: Fingerprint) -> str:
    total, magnitudes, squares = found
    return f"sum {total:.9g}, sum of magnitudes {magnitudes:.9g}, sum of squares {squares:.9g}"


def settle(
    step: int,
    found: list[Disagreement],
    ring: Ring,
    ties: dict[tuple[int, int], Fingerprint],
    rtol: float,
) -> Verdict | None:
    """The verdict of a checked step from its disagreements and the third ranks' recomputes
    (`ties`: (owner, checker) -> the third's fingerprint of the owner's micro-batch)."""
    if not found:
        return None
    named = named_by_pairs(found) if ring.world > 2 else set()
    lines = [describe(d) for d in found]
    for d in found:
        if d.owner in named or d.checker in named or (d.owner, d.checker) not in ties:
            continue
        third = ring.third(d.owner, d.checker)
        tie = ties[(d.owner, d.checker)]
        if agree(tie, d.checked, rtol):
            named.add(d.owner)
            lines.append(f"rank {third}'s recompute agrees with rank {d.checker}'s")
        elif agree(tie, d.own, rtol):
            named.add(d.checker)
            lines.append(f"rank {third}'s recompute agrees with rank {d.owner}'s own")
        else:
            lines.append(f"rank {third}'s recompute agrees with neither ({tie[0]:.9g}, "
                         f"{tie[1]:.9g})")  # fmt: skip
    if ring.world == 2:
        lines.append("two ranks: no third to say which is wrong")
    return Verdict(step=step, ranks=sorted(named), evidence="; ".join(lines))


def ties_needed(found: list[Disagreement], ring: Ring) -> list[tuple[int, int]]:
    """The (owner, checker) pairs a third rank must decide: those no other pair explains."""
    if ring.world <= 2:
        return []
    named = named_by_pairs(found)
    return [(d.owner, d.checker) for d in found if d.owner not in named and d.checker not in named]
