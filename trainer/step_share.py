"""What the ranks agree on after every step, in one small all-gather.

Every rank must take the same decision at the same step (to stop, to checkpoint), or the next
collective would pair a rank that saves with one that trains. Each rank contributes what it
knows (its stop request, its times, its own gradient norm), and every rank reads the same table.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

# Exit status of ranks that found non-finite numbers: the attempt fails and the run resumes
# from the last committed checkpoint, which holds none of them.
EXIT_NON_FINITE = 3
# Rank 0's call on a checkpoint at this step: none, the store's, or the peer tier's.
NO_SAVE, STORE_SAVE, PEER_SAVE = 0, 1, 2


@dataclass(frozen=True)
class StepShare:
    stop: int  # the strongest stop request of any rank (a vote of trainer.stop_reasons)
    save: bool  # rank 0's call on a time- or epoch-based checkpoint, the same on every rank
    peer: bool  # rank 0's call on a peer-tier checkpoint (trainer.peer_tier)
    step_s: list[float]  # every rank's step time
    grad_norm: list[float]  # every rank's local gradient norm
    forward_s: list[float]  # every rank's forward time: its own speed (trainer.stragglers)
    loss: list[float]  # every rank's own loss (NaN where a script reports none)


def share_step(
    stop: int, save: int, step_s: float, grad_norm: float, forward_s: float, loss: float
) -> StepShare:
    """`save` is NO_SAVE, STORE_SAVE or PEER_SAVE (rank 0's counts). One all-gather of six
    numbers per rank, for what the ranks must agree on and what the
    health checks compare across ranks. A gang of one rank agrees with itself: it gets the
    same table without the collective."""
    rows = gather_rows([float(stop), float(save), step_s, grad_norm, forward_s, loss])
    stops, saves, step_s_, norms, forward, losses = (list(c) for c in zip(*rows, strict=True))
    return StepShare(
        stop=int(max(stops)),
        save=int(saves[0]) == STORE_SAVE,
        peer=int(saves[0]) == PEER_SAVE,
        step_s=step_s_,
        grad_norm=norms,
        forward_s=forward,
        loss=losses,
    )


def gather_rows(values: list[float]) -> list[list[float]]:
    """Every rank's `values` (as many on each rank), by rank, in one all-gather; a gang of one
    rank has only its own, without the collective."""
    if dist.get_world_size() == 1:
        return [[float(v) for v in values]]
    mine = torch.tensor(values, dtype=torch.float64)
    everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return [t.tolist() for t in everyone]
