"""Which watch sees a rank's own gradients before the reduction, for the model's layout."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel

from trainer.ddp_buckets import settle_buckets
from trainer.grad_watch import OwnGradients, PreReduceNorms
from trainer.shard_watch import ShardedPreReduceNorms


def own_gradients(
    model: torch.nn.Module,
    replicate_group: dist.ProcessGroup | None,
    tensor_parallel: bool,
    poison_now: Callable[[], float | None],
    micro_now: Callable[[], int],
) -> OwnGradients | None:
    """The watch for this model's layout: DDP's all-reduce hook, FSDP's reduce-scatter (with
    tensor parallelism inside, a rank's buffers hold its slice of the weights' gradients);
    None where nothing is reduced (one rank, tensor parallelism alone) or DDP wraps a tensor
    parallel model (its recompute would need its group's collectives, which DDP's own does
    not run)."""
    if (
        isinstance(model, DistributedDataParallel)
        and replicate_group is not None
        and not tensor_parallel
    ):
        watch = PreReduceNorms(model, replicate_group, poison_now, micro_now)
        settle_buckets(model, watch.dry())  # every step in one layout: exact resume
        return watch
    if isinstance(model, FSDPModule):
        return ShardedPreReduceNorms(model, poison_now, micro_now)
    return None
