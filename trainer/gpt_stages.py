"""The built-in GPT split into pipeline stages, every parameter under the name it has in the
whole model, so a checkpoint is the same set of names whatever the pipeline's degree.

A stage holds a run of consecutive blocks (`blocks.<i>` keeps its index, in a ModuleDict); the
first stage also the embeddings (`wte`, `wpe`), the last the final norm and the head. The head
reads out through the embedding's matrix (tied), so the last stage holds a copy of `wte` too,
as the whole model does under the same name: the optimizer's state is kept under `wte.weight`
on both ranks, and the model's state has `wte.weight` and `lm_head.weight`, as a checkpoint of
the whole model does. `trainer.pipeline.TiedGradients` sums the two copies' gradients, so they
take the same step and stay equal.

A rank holds one module for its checkpoint and optimizer (`StagedGPT.module`: all of its
stages' parameters, under their names) and one module a stage for the schedule
(`StagedGPT.parts`), which share those parameters.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from trainer.model import GPT, GPTConfig
from trainer.parallel import Layout, Placement, built_on_meta, fill, shard_in_place
from trainer.pipeline import Pipeline, PipelineSettings


class GPTStage(nn.Module):
    """Some blocks of a GPT, with the embeddings if `first`, the norm and head if `last`."""

    def __init__(self, model: GPT, layers: Iterable[int], first: bool, last: bool) -> None:
        super().__init__()
        self.config: GPTConfig = model.config
        self.first, self.last = first, last
        if first or last:  # the last stage's is the head's tied matrix
            self.wte = model.wte
        if first:
            self.wpe = model.wpe
            self.drop = model.drop
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in layers})
        if last:
            self.ln_f = model.ln_f
            self.lm_head = model.lm_head

    def tie_weights(self) -> None:
        if self.last:
            self.lm_head.weight = self.wte.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids (B, T) into the first stage, the residual stream (B, T, C) between stages,
        logits (B, T, V) out of the last."""
        if self.first:
            T = x.size(1)
            if self.config.block_size < T:
                raise ValueError(f"sequence length {T} exceeds block_size {self.config.block_size}")
            x = self.wte(x)
            if self.wpe is not None:
                x = x + self.wpe(torch.arange(T, device=x.device))
            x = self.drop(x)
        for block in self.blocks.values():
            x = block(x)
        if self.last:
            return self.lm_head(self.ln_f(x))
        return x


def stage_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The last stage's loss of one micro-batch: GPT.forward's."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


@dataclass
class StagedGPT:
    """This rank's part of a pipelined GPT."""

    module: GPTStage  # every parameter of the rank's stages: what is checkpointed and optimized
    parts: list[GPTStage]  # one module a stage, for the schedule (replicas average their
    # gradients after it: trainer.pipeline.ReplicaGradients)

    @property
    def tied(self) -> list[nn.Parameter]:
        """The rank's copies of the weights the first and last stages share."""
        return [self.module.wte.weight] if self.module.first or self.module.last else []


def split(model: GPT, settings: PipelineSettings, pipeline_rank: int) -> StagedGPT:
    """The stages of `model` that `pipeline_rank` holds (a model on the meta device is split
    as well: nothing is copied)."""
    ids = settings.stages_of(pipeline_rank)
    layers = {stage: settings.layers_of(stage, model.config.n_layer) for stage in ids}
    last = settings.stages - 1

    def stage(ids_: Sequence[int]) -> GPTStage:
        held = [layer for s in ids_ for layer in layers[s]]
        return GPTStage(model, sorted(held), 0 in ids_, last in ids_)

    return StagedGPT(stage(ids), [stage([s]) for s in ids])


def build_stages(
    config: GPTConfig,
    seed: int,
    layout: Layout,
    placement: Placement,
    device: torch.device,
    settings: PipelineSettings,
) -> StagedGPT:
    """This rank's stages of the GPT with the seeded initial weights (bitwise those of the
    whole model's eager build), split as the layout says inside each stage; built on the meta
    device, so no rank ever holds more than its stages."""
    model, inits = built_on_meta(config, seed)
    staged = split(model, settings, placement.mesh.get_local_rank("pipeline"))
    shard_in_place(staged.module, layout, placement.mesh, roots=list(staged.parts))
    fill(staged.module, inits, device, parts=list(staged.parts))
    return staged


def stage_model(
    model: GPT, layout: Layout, placement: Placement, settings: PipelineSettings
) -> StagedGPT:
    """This rank's stages of a GPT built whole (fine-tuning: its weights loaded already)."""
    staged = split(model, settings, placement.mesh.get_local_rank("pipeline"))
    shard_in_place(staged.module, layout, placement.mesh, roots=list(staged.parts))
    return staged


class StagesInOrder(nn.Module):
    """The GPT's forward over every stage in order, one batch at a time, for the held-out loss
    (`trainer.evaluate.held_out_loss` calls it as it calls a GPT): a rank runs each of its
    stages when that stage's input arrives, sends its output to the next stage's rank, and
    the last rank's loss goes to every rank of the pipeline. No schedule: a held-out batch of
    any size, the last one short, is scored whole."""

    def __init__(self, staged: StagedGPT, pipeline: Pipeline) -> None:
        super().__init__()
        self.module = staged.module  # a child: eval() and train() reach its dropout
        self._pipeline = pipeline
        self._stages = dict(zip(pipeline.ids, staged.parts, strict=True))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[None, torch.Tensor]:
        pipeline, width = self._pipeline, self.module.config.n_embd
        settings = pipeline.settings
        hidden = torch.empty(0)
        for stage in range(settings.stages):
            if stage not in self._stages:
                continue
            if stage > 0:  # loop placement: the stage before is on the rank before
                hidden = torch.empty(*x.shape, width, device=x.device)
                dist.recv(hidden, group=pipeline.group, group_src=(stage - 1) % settings.ranks)
            hidden = self._stages[stage](x if stage == 0 else hidden)
            if stage < settings.stages - 1:  # the residual stream travels in float32
                dist.send(
                    hidden.float(), group=pipeline.group, group_dst=(stage + 1) % settings.ranks
                )
        loss = stage_loss(hidden, y) if pipeline.last else torch.zeros((), device=x.device)
        dist.broadcast(loss, group=pipeline.group, group_src=settings.ranks - 1)
        return None, loss
