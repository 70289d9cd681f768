"""Pipeline parallelism: which stages of a model a rank holds, the schedule that runs them, and
what a pipeline needs beside it.

A model of S stages (its layers split in order) runs on P pipeline ranks, each holding
S / P of them (`torch.distributed.pipelining`). Stages are placed in a loop: rank r holds
stages r, r + P, r + 2P, ..., so the first stage (the embeddings) is always on rank 0 and the
last (the head and the loss) on rank P − 1. A step splits each data-parallel rank's batch into
M micro-batches: rank 0 feeds them in, the last rank computes their losses, activations go
forward and their gradients back between neighbouring ranks, and the schedule decides the
order:

- `1F1B` (Narayanan et al. 2021): one stage a rank; after P − 1 forwards to fill the
  pipeline, each rank alternates one forward and one backward, so at most P micro-batches'
  activations are held at once. It needs M ≥ P. Idle share of a step: (P − 1)/(M + P − 1).
- `interleaved-1F1B`: v stages a rank; the idle share falls to (P − 1)/(v·M + P − 1), for v
  times the point-to-point traffic.
- `zero-bubble` (Qi et al. 2023): interleaved, each backward split into its input half (which
  the previous stage waits for) and its weight half (which can wait), which fills the idle
  slots.

What a pipeline adds to a step: the weights that the first and last stages share (a tied
embedding) get their gradients summed across the two ranks (`TiedGradients`), and the mean
loss, known only to the last rank, is sent to every rank of the pipeline, so each reports the
step's loss as a data-parallel rank does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from infra.capacity import Pipelining
from trainer.stragglers import forward_timer

# torch.distributed.pipelining's schedules by the spec's names (imported when a pipeline is
# made: its import takes 0.6 s, which every rank without a pipeline would pay at its start).
_SCHEDULES = {
    "1F1B": "Schedule1F1B",
    "interleaved-1F1B": "ScheduleInterleaved1F1B",
    "zero-bubble": "ScheduleInterleavedZeroBubble",
}


class PipelineSplitError(ValueError):
    """A model that cannot be split as the spec's pipeline asks; the message says why."""


@dataclass(frozen=True)
class PipelineSettings:
    """The spec's pipeline as the job file carries it (`TrainJob.layout`)."""

    ranks: int = 1  # parallel.pipeline
    schedule: str = "1F1B"
    stages_per_rank: int = 1
    microbatches: int = 1

    @classmethod
    def from_layout(cls, layout: dict) -> PipelineSettings:
        keys = {"pipeline": "ranks", "schedule": "schedule",
                "stages_per_rank": "stages_per_rank", "microbatches": "microbatches"}  # fmt: skip
        return cls(**{ours: layout[theirs] for theirs, ours in keys.items() if theirs in layout})

    @property
    def on(self) -> bool:
        return self.ranks > 1

    @property
    def stages(self) -> int:
        return self.ranks * self.stages_per_rank

    def stages_of(self, pipeline_rank: int) -> list[int]:
        """The stages a pipeline rank holds, in the loop placement every schedule here uses."""
        return [pipeline_rank + k * self.ranks for k in range(self.stages_per_rank)]

    def layers_of(self, stage: int, layers: int) -> range:
        """The layers of `stage` when `layers` split evenly over the stages, in order."""
        if layers % self.stages:
            raise PipelineSplitError(
                f"{layers} layers do not split evenly over {self.stages} stages "
                f"(parallel.pipeline {self.ranks} × stages_per_rank {self.stages_per_rank}): "
                "choose a pipeline whose stages divide the model's layers"
            )
        per = layers // self.stages
        return range(stage * per, (stage + 1) * per)

    def bubble(self) -> float:
        """The schedule's idle share of a step, in theory (see the module's docstring)."""
        shape = Pipelining(self.ranks, self.stages_per_rank, self.microbatches, self.schedule)
        return shape.bubble()


LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class Pipeline:
    """This rank's stages and the schedule that runs them; `step(x, y)` is one optimizer
    step's forward and backward over every micro-batch. Every rank of the pipeline calls it
    with its data-parallel rank's batch (the first stage reads x, the last y)."""

    def __init__(
        self,
        modules: Sequence[nn.Module],
        settings: PipelineSettings,
        mesh: DeviceMesh,
        device: torch.device,
        loss_fn: LossFn,
        tied: Sequence[nn.Parameter] | None = None,
    ) -> None:
        """`tied`: None where the first and last stages share no weight (on every rank
        alike), else this rank's copies of the shared weights (none on a middle rank)."""
        self.settings = settings
        self.group = mesh.get_group("pipeline")
        self.rank = mesh.get_local_rank("pipeline")
        self.ids = settings.stages_of(self.rank)
        if len(modules) != len(self.ids):
            raise PipelineSplitError(
                f"pipeline rank {self.rank} holds stages {self.ids}: pass one module for each, "
                f"not {len(modules)}"
            )
        from torch.distributed import pipelining

        stages = [
            pipelining.PipelineStage(module, stage, settings.stages, device, group=self.group)
            for module, stage in zip(modules, self.ids, strict=True)
        ]
        # The stages' own forward time, without the waits for the neighbours: what the
        # straggler watch compares among the ranks of a stage (trainer.stragglers).
        self._timer = forward_timer(device)
        for module in modules:
            module.register_forward_pre_hook(lambda *_: self._timer.start())
            module.register_forward_hook(lambda *_: self._timer.stop())
        schedule = getattr(pipelining, _SCHEDULES[settings.schedule])
        self._schedule = schedule(
            stages[0] if len(stages) == 1 else stages,
            n_microbatches=settings.microbatches,
            loss_fn=loss_fn,
        )
        self.first = 0 in self.ids
        self.last = settings.stages - 1 in self.ids
        # Every global rank's pipeline rank (the mesh's first coordinate): the straggler watch
        # compares a rank with those of its own stage.
        grid = mesh.mesh.reshape(mesh.mesh.shape[0], -1).tolist()
        stage_of = {rank: position for position, ranks in enumerate(grid) for rank in ranks}
        self.stage_of_each_rank = [stage_of[rank] for rank in range(len(stage_of))]
        self._tied = TiedGradients(mesh, tied)
        self._replicas = ReplicaGradients(mesh, modules)
        self._device = device
        # The last rank's copies of tied weights: their norm is the first rank's.
        self.counted_elsewhere = {id(p) for p in tied or ()} if not self.first else set()

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Forward and backward of every micro-batch of (x, y); the gradients are those of the
        mean loss over the batch, as one forward and backward of it would give. Returns that
        mean loss on every rank of the pipeline."""
        losses: list[torch.Tensor] = []
        if self.first and self.last:  # one stage: no pipeline (a script run with pipeline = 1)
            self._schedule.step(x, target=y, losses=losses)
        elif self.first:
            self._schedule.step(x)
        elif self.last:
            self._schedule.step(target=y, losses=losses)
        else:
            self._schedule.step()
        self._tied.sum()
        self._replicas.average()
        loss = (
            torch.stack([part.detach() for part in losses]).mean()
            if self.last
            else torch.zeros((), device=self._device)
        )
        dist.broadcast(loss, group=self.group, group_src=self.settings.ranks - 1)
        return loss

    def take_forward_s(self) -> float:
        """The stages' forward time since the last call (a step's), on this rank's clock."""
        seconds = self._timer.seconds()
        self._timer = forward_timer(self._device)
        return seconds

    @contextlib.contextmanager
    def untimed(self) -> Iterator[None]:
        """Forwards that are not the step's (an evaluation) leave the step's time as it was."""
        kept, self._timer = self._timer, forward_timer(self._device)
        try:
            yield
        finally:
            self._timer = kept

    def summed(self, value: torch.Tensor) -> torch.Tensor:
        """`value` summed over the pipeline's ranks (a norm's squares, each of its stages)."""
        total = value.to(self._device)
        dist.all_reduce(total, group=self.group)
        return total.to(value.device)


class TiedGradients:
    """A weight held by both the first and the last stage (a tied embedding and head): each
    rank's copy gets the gradient of its own use only, so the two are summed across the pair,
    and both copies take the same optimizer step and stay equal."""

    def __init__(self, mesh: DeviceMesh, params: Sequence[nn.Parameter] | None) -> None:
        self.params = list(params or ())
        self.group: dist.ProcessGroup | None = None
        if params is None:
            return
        # One group per (replicate, shard, tensor) coordinate: its first and last pipeline
        # ranks. Every rank creates every group, in the same order (new_group's rule).
        grid = mesh.mesh.reshape(mesh.mesh.shape[0], -1)
        pairs = [[int(grid[0, i]), int(grid[-1, i])] for i in range(grid.shape[1])]
        self.group, _ = dist.new_subgroups_by_enumeration(pairs)

    def sum(self) -> None:
        if self.group is None or not self.params:
            return
        for param in self.params:
            grad = param.grad
            if grad is None:  # this stage took no gradient for it: add nothing
                grad = param.grad = torch.zeros_like(param)
            local = grad.to_local() if hasattr(grad, "to_local") else grad
            dist.all_reduce(local, group=self.group)


class ReplicaGradients:
    """The replicas of a stage (`replicate` without FSDP, which reduces its own) average their
    gradients after the schedule's step, in one all-reduce of them all flattened: DDP's
    reducer cannot follow a schedule that runs backward once a micro-batch (it rebuilds its
    buckets from the first step's order and finds every parameter twice), and one flat buffer
    adds up in the same order every step of every attempt (exact resume)."""

    def __init__(self, mesh: DeviceMesh, modules: Sequence[nn.Module]) -> None:
        self.group = mesh.get_group("replicate") if mesh["replicate"].size() > 1 else None
        self.size = mesh["replicate"].size()
        seen: dict[int, nn.Parameter] = {}
        for module in modules:
            seen |= {id(p): p for p in module.parameters() if p.requires_grad}
        self.params = list(seen.values())

    def average(self) -> None:
        if self.group is None:
            return
        # Sharded gradients (DTensors) are FSDP's, reduced over its mesh already.
        grads = [
            p.grad for p in self.params if p.grad is not None and not hasattr(p.grad, "to_local")
        ]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.group)
        flat /= self.size
        offset = 0
        for grad in grads:
            grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
            offset += grad.numel()
