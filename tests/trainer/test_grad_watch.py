"""Naming the replica whose gradients went bad, from every replica's norm before the all-reduce."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

from infra.processes import free_port
from trainer.ddp_buckets import settle_buckets
from trainer.grad_watch import ChaosPoison, PreReduceNorms, suspects
from trainer.shard_watch import ShardedPreReduceNorms

NAN = math.nan


def test_a_non_finite_replica_among_finite_ones_is_named() -> None:
    assert suspects([1.2, NAN, 0.9]) == [1]
    assert suspects([NAN, 0.8]) == [0]
    assert suspects([math.inf, 1.0, NAN, 1.1]) == [0, 2]


def test_every_replica_alike_is_divergence_not_a_machine() -> None:
    assert suspects([NAN, NAN]) == []
    assert suspects([1e9, 1.1e9, 0.9e9]) == []  # all huge together: the run diverges


def test_a_huge_norm_needs_a_majority_to_call_it_an_outlier() -> None:
    assert suspects([1.0, 500.0, 1.2, 0.9]) == [1]
    assert suspects([1.0, 50.0, 1.2]) == []  # different batches differ; not 100× apart
    assert suspects([1.0, 500.0]) == []  # two replicas: which one is normal?


def test_a_chaos_order_scales_every_buffer_of_its_steps_first_micro_batch(tmp_path: Path) -> None:
    """`corrupt-grad --finite --scale 1.02 --at-step 5`: each bucket (DDP) or block (FSDP)
    reduced in step 5's first micro-batch, and nothing else, ever again."""
    order = tmp_path / "CHAOS"
    order.write_text("corrupt-grad 5 1.02\n")
    now = {"step": 4, "micro": 1}
    poison = ChaosPoison(order, lambda: now["step"], lambda: now["micro"])
    assert poison() is None and order.exists()  # not due yet
    now["step"] = 5
    assert [poison(), poison()] == [1.02, 1.02] and not order.exists()  # two buffers
    now["micro"] = 2
    assert poison() is None  # the step's second micro-batch is computed right
    now.update(step=6, micro=1)
    assert poison() is None


class _KeptBuffers(PreReduceNorms):
    """The real DDP watch, keeping a copy of each bucket it sees: the test's reference."""

    def __init__(self, model: DistributedDataParallel, group: dist.ProcessGroup) -> None:
        super().__init__(model, group)
        self.buffers: list[torch.Tensor] = []

    def _seen(self, buffer: torch.Tensor, pieces: Callable) -> None:  # type: ignore[override]
        self.buffers.append(buffer.detach().clone())
        super()._seen(buffer, pieces)


def _host_accumulated_norm(buffers: list[torch.Tensor]) -> float:
    """The norm as the watch took it before: each bucket's sum copied to a host float64."""
    squares = torch.zeros((), dtype=torch.float64)
    for buffer in buffers:
        squares += buffer.double().pow(2).sum().cpu()
    return math.sqrt(float(squares))


def _ddp_rank(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(64, 64) for _ in range(4)))
    # Small buckets: a step's norm adds up several of them.
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.02)
    watch = _KeptBuffers(ddp, dist.group.WORLD)
    settle_buckets(ddp, watch.dry())  # as the SDK does: the small buckets from the first step
    data = torch.Generator().manual_seed(rank)
    rows = []
    for _ in range(3):
        watch.buffers.clear()
        ddp(torch.randn(8, 64, generator=data)).pow(2).mean().backward()
        held = watch._squares  # what the hooks left: a tensor where the buckets were
        assert held is not None and held.device == watch.buffers[0].device
        rows.append((len(watch.buffers), watch.take(), _host_accumulated_norm(watch.buffers)))
        assert watch._squares is None  # read once, and reset for the next step
        ddp.zero_grad()
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(rows, f)
    dist.destroy_process_group()


def test_the_hooks_sum_on_the_device_and_the_step_reads_the_same_norm(tmp_path: Path) -> None:
    """Two real DDP ranks: each step's own norm is bit for bit the host-accumulated one, over
    several buckets and steps."""
    mp.spawn(_ddp_rank, args=(free_port(), str(tmp_path)), nprocs=2)
    for rank in (0, 1):
        rows = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for buckets, taken, reference in rows:
            assert buckets > 1
            assert taken == reference and taken > 0


def test_a_bucket_is_summed_without_a_copy_to_the_host() -> None:
    """A meta tensor has no values to copy: the hook's arithmetic stays where its bucket is,
    as on a GPU, and nothing is read until the step takes the norm."""
    watch = ShardedPreReduceNorms(torch.nn.Linear(2, 2))  # no FSDP units: nothing hooked
    for _ in range(2):
        watch._seen(torch.ones(16, device="meta"), lambda: [])
    assert watch._squares is not None and watch._squares.device.type == "meta"
    assert watch._squares.dtype == torch.float64
