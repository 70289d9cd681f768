"""A run's plan: time and cost of the token budget, failures, checkpoints, goodput, and a fit.

Reliability is the first-order model the trainer's `checkpoint_every = "auto"` uses: nodes fail
independently, so a gang of N fails N times as often as one node; Young's interval √(2·C·M) and
Daly's first-order correction √(2·C·M) − C for a save costing C seconds and a gang MTBF of M.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from infra.capacity import (
    RECOMPUTE_FLOPS,
    Memory,
    Pipelining,
    Precision,
    Shape,
    flops_per_token,
    memory_per_gpu,
    non_embedding_params,
    param_count,
)
from infra.capacity_hardware import Hardware

GIB = 1 << 30


@dataclass(frozen=True)
class Layout:
    nodes: int
    gpus_per_node: int
    replicate: int
    shard: int
    tensor: int
    recompute: str = "none"  # activation checkpointing: none, selective or full
    pipeline: Pipelining = field(default_factory=Pipelining)

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def data_parallel(self) -> int:
        return self.replicate * self.shard


@dataclass(frozen=True)
class Budget:
    steps: int
    batch_size: int  # sequences per optimizer step, all ranks together
    grad_accum_steps: int = 1
    checkpoint_every: int | None = None  # steps; None: "auto" (Daly's interval)

    def micro_batch(self, layout: Layout) -> int:
        """Sequences one rank runs per forward: tensor-parallel ranks share theirs, and a
        pipeline splits a rank's batch into its micro-batches."""
        split = layout.data_parallel * self.grad_accum_steps * layout.pipeline.microbatches
        return max(1, self.batch_size // split)


def gang_mtbf_s(node_mtbf_hours: float, nodes: int) -> float:
    return node_mtbf_hours * 3600 / nodes


def young_interval_s(save_s: float, mtbf_s: float) -> float:
    return math.sqrt(2 * save_s * mtbf_s)


def daly_interval_s(save_s: float, mtbf_s: float) -> float:
    """Daly (2006), first order; past C ≥ M/2 the expansion fails: one save per MTBF is best."""
    return mtbf_s if save_s >= mtbf_s / 2 else young_interval_s(save_s, mtbf_s) - save_s


def goodput(
    save_s: float,
    interval_s: float,
    restart_s: float,
    mtbf_s: float,
    mtbp_s: float = math.inf,
    resume_s: float | None = None,
) -> float:
    """Useful fraction of wall time, first order: each period of τ work plus a C-second save
    loses C to saving; a failure, once per M on average, loses half a period and the restart.
    A preemption, once per `mtbp_s`, loses no work (the ranks save first, on notice): the save
    and the resume (`resume_s`, else the restart), not counting the wait for nodes again."""
    period = interval_s + save_s
    resume = restart_s if resume_s is None else resume_s
    lost = save_s / period + (period / 2 + restart_s) / mtbf_s + (save_s + resume) / mtbp_s
    return max(0.0, 1 - lost)


def save_seconds(checkpoint_bytes: float, nodes: int, hardware: Hardware) -> float:
    """Every rank writes its own shard, so nodes write in parallel, capped by the storage."""
    bandwidth = hardware.write_gb_per_s_per_node * 1e9 * nodes
    if hardware.write_gb_per_s is not None:
        bandwidth = min(bandwidth, hardware.write_gb_per_s * 1e9)
    return checkpoint_bytes / bandwidth


@dataclass(frozen=True)
class Plan:
    params: int
    non_embedding_params: int
    flops_per_token: float
    precision: Precision
    model_state_bytes: int
    micro_batch: int
    bubble: float  # the pipeline's idle share of a step
    pipeline_bytes_per_step: float  # activations and their gradients between stages, a rank
    memory: Memory
    usable_memory_bytes: float
    tokens: int
    tokens_per_s: float
    step_s: float
    compute_s: float
    gang_mtbf_s: float
    checkpoint_bytes: int
    checkpoint_bytes_per_rank: float
    save_s: float
    young_s: float
    daly_s: float
    interval_s: float  # the spec's checkpoint_every in seconds, or Daly's when it is "auto"
    goodput_optimal: float
    goodput: float
    wall_s: float
    expected_failures: float
    gpu_hours: float
    cost_per_hour: float
    cost: float

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.usable_memory_bytes


def make_plan(
    shape: Shape,
    layout: Layout,
    budget: Budget,
    precision: Precision,
    hardware: Hardware,
    node_mtbf_hours: float,
) -> Plan:
    params, world = param_count(shape), layout.world
    flops_tok = flops_per_token(shape)
    micro = budget.micro_batch(layout)
    memory = memory_per_gpu(
        shape, precision, layout.shard, layout.tensor, micro, hardware.flash_attention,
        layout.recompute, layout.pipeline,
    )  # fmt: skip
    tokens = budget.steps * budget.batch_size * shape.block_size
    # A full recompute runs every forward twice: the GPUs work as hard, on fewer tokens; a
    # pipeline's ranks idle for its bubble.
    work_per_token = flops_tok * RECOMPUTE_FLOPS[layout.recompute]
    bubble = layout.pipeline.bubble()
    tokens_per_s = (
        world * hardware.peak_flops_per_gpu * hardware.mfu * (1 - bubble) / work_per_token
    )
    step_s = budget.batch_size * shape.block_size / tokens_per_s
    mtbf = gang_mtbf_s(node_mtbf_hours, layout.nodes)
    checkpoint = params * precision.checkpoint_per_param
    save = save_seconds(checkpoint, layout.nodes, hardware)
    daly = daly_interval_s(save, mtbf)
    interval = daly if budget.checkpoint_every is None else budget.checkpoint_every * step_s
    useful = goodput(save, interval, hardware.restart_s, mtbf)
    compute = tokens / tokens_per_s
    wall = compute / useful if useful > 0 else math.inf
    gpu_hours = world * wall / 3600
    return Plan(
        params=params,
        non_embedding_params=non_embedding_params(shape),
        flops_per_token=flops_tok,
        precision=precision,
        model_state_bytes=params * precision.per_param,
        micro_batch=micro,
        bubble=bubble,
        pipeline_bytes_per_step=pipeline_bytes(shape, layout, micro),
        memory=memory,
        usable_memory_bytes=hardware.gpu_memory_gib * GIB * hardware.usable_memory_fraction,
        tokens=tokens,
        tokens_per_s=tokens_per_s,
        step_s=step_s,
        compute_s=compute,
        gang_mtbf_s=mtbf,
        checkpoint_bytes=checkpoint,
        checkpoint_bytes_per_rank=checkpoint / world,
        save_s=save,
        young_s=young_interval_s(save, mtbf),
        daly_s=daly,
        interval_s=interval,
        goodput_optimal=goodput(save, daly, hardware.restart_s, mtbf),
        goodput=useful,
        wall_s=wall,
        expected_failures=wall / mtbf,
        gpu_hours=gpu_hours,
        cost_per_hour=world * hardware.cost_per_gpu_hour,
        cost=gpu_hours * hardware.cost_per_gpu_hour,
    )


# Activation recomputation from the cheapest: selective recomputes no product, full every one.
_RECOMPUTE_ORDER = ("none", "selective", "full")


def pipeline_bytes(shape: Shape, layout: Layout, micro_batch: int) -> float:
    """What a pipeline rank sends and receives a step: each micro-batch's activations forward
    and their gradients back, 16-bit, at each of its stages' boundaries (a tensor-parallel
    rank sends its share)."""
    pipe = layout.pipeline
    if pipe.ranks == 1:
        return 0.0
    per_micro = shape.block_size * micro_batch * shape.n_embd * 2 / layout.tensor
    return 2 * 2 * per_micro * pipe.microbatches * pipe.stages_per_rank


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def what_would_fit(
    shape: Shape, layout: Layout, budget: Budget, precision: Precision, hardware: Hardware
) -> dict[str, int | str] | None:
    """The smallest change to the layout that fits, tried cheapest first: more sharding (same
    data-parallel ranks, same batch); then activation recomputation, selective (almost no
    compute) before full (a third more), where the spec recomputes less; then smaller
    micro-batches by gradient accumulation with tensor parallelism inside a node. None if
    nothing does at this gang size."""
    usable = hardware.gpu_memory_gib * GIB * hardware.usable_memory_fraction
    ranks = layout.world // layout.pipeline.ranks  # those of one stage: the rest split them

    def fits(lay: Layout, accum: int) -> bool:
        micro = replace(budget, grad_accum_steps=accum).micro_batch(lay)
        memory = memory_per_gpu(
            shape, precision, lay.shard, lay.tensor, micro, hardware.flash_attention,
            lay.recompute, lay.pipeline,
        )  # fmt: skip
        return memory.total <= usable

    def sharded(tensor: int, shard: int) -> Layout:
        return replace(layout, replicate=ranks // (tensor * shard), shard=shard, tensor=tensor)

    accum = budget.grad_accum_steps
    shards = [s for s in _divisors(ranks // layout.tensor) if s >= layout.shard]
    for mode in _RECOMPUTE_ORDER[_RECOMPUTE_ORDER.index(layout.recompute) :]:
        for shard in shards:
            if (mode, shard) == (layout.recompute, layout.shard):
                continue
            if fits(replace(sharded(layout.tensor, shard), recompute=mode), accum):
                change: dict[str, int | str] = {}
                if shard != layout.shard:
                    change |= {"shard": shard, "replicate": ranks // (layout.tensor * shard)}
                if mode != layout.recompute:
                    change["activation_checkpointing"] = mode
                return change
    for tensor in _divisors(layout.gpus_per_node):
        if tensor < layout.tensor or shape.n_head % tensor or shape.n_embd % tensor:
            continue
        if ranks % tensor:
            continue
        data_parallel = ranks // tensor
        if budget.batch_size % data_parallel:
            continue
        for mode in _RECOMPUTE_ORDER[_RECOMPUTE_ORDER.index(layout.recompute) :]:
            full = replace(sharded(tensor, data_parallel), recompute=mode)
            # A pipeline's micro-batches are its accumulation (the spec refuses both).
            piped = layout.pipeline.ranks > 1
            for more in [accum] if piped else _divisors(budget.batch_size // data_parallel):
                if more >= accum and fits(full, more):
                    change = {"tensor": tensor, "shard": data_parallel, "replicate": 1}
                    if mode != layout.recompute:
                        change["activation_checkpointing"] = mode  # type: ignore[assignment]
                    return change | {"accum": more}
    return None
