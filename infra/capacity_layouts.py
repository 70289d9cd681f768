"""A layout for a model and a GPU count: every way to split it (tensor × pipeline × data
parallel, recomputation, schedule), those that fit, ranked by the MFU each would reach.

The plan (infra/capacity_plan.py) takes the MFU a run reaches as an assumption; to compare
layouts, this module estimates what each loses to the rest of a step, from first principles:

- compute: the model's FLOPs a step (6·N·tokens, and a second forward for a full recompute)
  at the assumed MFU of the kernels (`Hardware.mfu`);
- the pipeline's bubble: the ranks idle (P − 1)/(v·M + P − 1) of a step (zero-bubble a third);
- tensor parallelism: four all-reduces of the residual stream a layer and micro-batch
  (two forward, two backward) over NVLink, not overlapped: they sit between a layer's products;
- data parallelism: FSDP gathers a stage's weights twice (forward, backward, 16-bit) and
  reduce-scatters its gradients (32-bit), DDP all-reduces the gradients, over each GPU's share
  of the fabric, overlapped with the compute: only what outlasts it is lost;
- a pipeline's point-to-point traffic is small beside both, overlapped, and not counted.

An estimate to rank layouts by, not a measurement: the figures say what dominates.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from infra.capacity import (
    RECOMPUTE_FLOPS,
    Pipelining,
    Precision,
    Shape,
    flops_per_token,
    memory_per_gpu,
    stage_params,
)
from infra.capacity_hardware import Hardware
from infra.capacity_plan import GIB, Budget, Layout

_MODES = ("none", "selective", "full")
_MAX_BUBBLE = 0.25  # what the spec's microbatches = None keeps the bubble at most


@dataclass(frozen=True)
class Candidate:
    layout: Layout
    memory_bytes: float
    step_s: float
    compute_s: float
    bubble: float
    tensor_s: float  # tensor parallelism's all-reduces a step
    data_exposed_s: float  # data parallelism's traffic the compute did not hide
    mfu: float  # the model's FLOPs a step / (the step's time × the GPUs' peak)

    def describe(self) -> str:
        lay, pipe = self.layout, self.layout.pipeline
        parts = [f"tensor {lay.tensor}", f"pipeline {pipe.ranks}"]
        if pipe.ranks > 1:
            parts.append(f"{pipe.schedule} ×{pipe.stages_per_rank} M={pipe.microbatches}")
        parts.append(
            f"shard {lay.shard}" + (f" × replicate {lay.replicate}" if lay.replicate > 1 else "")
        )
        if lay.recompute != "none":
            parts.append(f"{lay.recompute} recompute")
        return ", ".join(parts)


def estimate(
    shape: Shape, layout: Layout, budget: Budget, precision: Precision, hardware: Hardware
) -> Candidate:
    """One layout's memory per GPU and step time, as the module's docstring models them."""
    pipe, world = layout.pipeline, layout.world
    micro = budget.micro_batch(layout)
    memory = memory_per_gpu(
        shape, precision, layout.shard, layout.tensor, micro, hardware.flash_attention,
        layout.recompute, pipe,
    ).total  # fmt: skip
    tokens = budget.batch_size * shape.block_size
    model_flops = flops_per_token(shape) * tokens
    kernels = hardware.peak_flops_per_gpu * hardware.mfu
    compute = model_flops * RECOMPUTE_FLOPS[layout.recompute] / (world * kernels)
    bubble = pipe.bubble()
    busy = compute / (1 - bubble)
    # Tensor parallelism: 4 ring all-reduces of (s·b·C) 16-bit values a layer and micro-batch.
    t = layout.tensor
    activations = shape.block_size * micro * shape.n_embd * 2
    per_layer = 4 * 2 * (t - 1) / t * activations if t > 1 else 0.0
    micro_batches = pipe.microbatches * budget.grad_accum_steps
    tensor_s = (
        per_layer * shape.n_layer / pipe.ranks * micro_batches / (hardware.nvlink_gb_per_s * 1e9)
    )
    # Data parallelism: each GPU's share of its stage's weights, over the fabric.
    held = stage_params(shape, pipe.ranks) / t
    if layout.data_parallel == 1:
        traffic = 0.0
    elif layout.shard > 1:
        traffic = held * (2 * precision.weights + 4)  # gather twice, reduce-scatter in fp32
    else:
        traffic = held * 2 * 4  # a ring all-reduce of fp32 gradients: twice their bytes
    data_s = traffic / (hardware.network_gb_per_s_per_gpu * 1e9)
    exposed = max(0.0, data_s - busy)
    step = busy + tensor_s + exposed
    mfu = model_flops / (step * world * hardware.peak_flops_per_gpu)
    return Candidate(layout, memory, step, compute, bubble, tensor_s, exposed, mfu)


def propose(
    shape: Shape,
    gpus: int,
    gpus_per_node: int,
    budget: Budget,
    precision: Precision,
    hardware: Hardware,
    best: int = 5,
) -> list[Candidate]:
    """The `best` layouts of `gpus` GPUs that fit, highest MFU first (fewer dimensions first
    where they tie). Tensor parallelism stays inside a node; every stage holds as many
    layers; each data-parallel rank's batch splits evenly."""
    usable = hardware.gpu_memory_gib * GIB * hardware.usable_memory_fraction
    found = [
        candidate
        for layout in _layouts(shape, gpus, gpus_per_node, budget)
        for candidate in [estimate(shape, layout, budget, precision, hardware)]
        if candidate.memory_bytes <= usable
    ]
    # Per split, the least recomputation that fits: more costs time (full) or nothing (the
    # selective recompute, which this model does not charge) and would only repeat the row.
    least: dict[tuple, Candidate] = {}
    for candidate in found:
        lay = candidate.layout
        least.setdefault((lay.tensor, lay.pipeline, lay.shard, lay.replicate), candidate)
    ranked = sorted(
        least.values(), key=lambda c: (-round(c.mfu, 4), c.layout.tensor, c.layout.pipeline.ranks)
    )
    return ranked[:best]


def _layouts(shape: Shape, gpus: int, gpus_per_node: int, budget: Budget):
    nodes = max(1, gpus // gpus_per_node)
    for tensor in _divisors(gpus_per_node):
        if shape.n_head % tensor or shape.n_embd % tensor or gpus % tensor:
            continue
        for ranks in _divisors(gpus // tensor):
            if shape.n_layer % ranks:
                continue
            data_parallel = gpus // (tensor * ranks)
            if budget.batch_size % data_parallel:
                continue
            local = budget.batch_size // data_parallel
            for pipe in _pipelines(shape, ranks, local):
                for shard, replicate in ((data_parallel, 1), (1, data_parallel)):
                    for mode in _MODES:
                        yield Layout(nodes, gpus_per_node, replicate, shard, tensor, mode, pipe)


def _pipelines(shape: Shape, ranks: int, local: int):
    """The schedules a pipeline of `ranks` could run a rank's batch of `local` sequences with:
    the fewest micro-batches that keep the bubble at most a quarter (else one sequence each)."""
    if ranks == 1:
        yield Pipelining()
        return
    for schedule, per_rank in (("1F1B", 1), ("interleaved-1F1B", 2), ("zero-bubble", 2)):
        if shape.n_layer % (ranks * per_rank):
            continue
        least = ranks if schedule == "1F1B" else 1
        fitting = [m for m in _divisors(local) if m >= least]
        if not fitting:
            continue
        pipe = Pipelining(ranks, per_rank, fitting[-1], schedule)
        for m in fitting:
            if replace(pipe, microbatches=m).bubble() <= _MAX_BUBBLE:
                pipe = replace(pipe, microbatches=m)
                break
        yield pipe


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
