"""What an FSDP rank computed itself, before the reduce-scatter mixes it (trainer.grad_watch's
`OwnGradients` for `fully_shard` models).

Under FSDP each rank's backward produces whole gradients for a block, which FSDP copies into one
flat buffer and reduce-scatters, so each rank keeps the average of its shard. That buffer is the
rank's own work, as a DDP bucket is: FSDP lets a module bring its own reduce-scatter
(`FSDPModule.set_custom_reduce_scatter`), and ours looks at the buffer (its norm, the chaos
poison, the shadow checks' record) and then reduces it as FSDP's own would.

A shadow recompute cannot be autograd alone here: the forward needs every rank's shards gathered,
so the whole gang runs it together, each rank on the micro-batch it checks. Its backward goes
through FSDP as a step's does, and FSDP builds the same buffers from it; our reduce-scatter
records them and reduces nothing (it hands back zeros, which leave the step's sharded gradients
as they were). The buffers are laid out as the owner's were in its real step, so the two sides
add the same numbers in the same order.

What it cannot see: a corrupt parameter shard is gathered into every rank's forward alike, so a
recompute agrees with it. A device's wrong arithmetic, which is in its own buffer only, it sees.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllocMixin

from trainer.grad_watch import OwnGradients
from trainer.shadow_check import Fingerprint, fingerprint, gradient_summary


class _WatchedReduceScatter(DefaultAllocMixin, ReduceScatter):
    """One FSDP module's reduce-scatter, reporting its input to the watch under `key`; its
    buffers are allocated as FSDP's default reduce-scatter's are."""

    def __init__(self, watch: ShardedPreReduceNorms, key: int) -> None:
        self.watch = watch
        self.key = key

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: dist.ReduceOp,
        async_op: bool = False,
    ) -> dist.Work | None:
        return self.watch._reduce(self.key, output_tensor, input_tensor, group, op, async_op)


class ShardedPreReduceNorms(OwnGradients):
    collective = True

    def __init__(
        self,
        model: torch.nn.Module,
        poison_now: Callable[[], float | None] = lambda: None,
        micro_now: Callable[[], int] = lambda: 1,
    ) -> None:
        super().__init__(poison_now, micro_now)
        # Each FSDP unit (a block, the root) reduces its own buffer; keyed in module order.
        units = [m for m in model.modules() if isinstance(m, FSDPModule)]
        for key, unit in enumerate(units):
            unit.set_custom_reduce_scatter(_WatchedReduceScatter(self, key))
        self._units = len(units)
        self._shadow: dict[int, torch.Tensor] | None = None  # a recompute's buffers, by unit

    def _reduce(
        self,
        key: int,
        output: torch.Tensor,
        buffer: torch.Tensor,
        group: dist.ProcessGroup,
        op: dist.ReduceOp,
        async_op: bool,
    ) -> dist.Work | None:
        if self._shadow is not None:  # a recompute: keep its summary, add nothing to the step
            self._shadow[key] = gradient_summary(buffer)
            output.zero_()
            return None
        self._seen(buffer, lambda: [(key, buffer)])
        return dist.reduce_scatter_single(output, buffer, group=group, op=op, async_op=async_op)

    def first_fingerprint(self, module: torch.nn.Module) -> tuple[Fingerprint, int]:
        return self._first_in(range(self._units))

    def recompute(self, module: torch.nn.Module, loss: Callable[[], torch.Tensor]) -> Fingerprint:
        """A forward and backward through FSDP (every rank at once, each on its own
        micro-batch), whose reduce-scatters record and add nothing."""
        self._shadow = {}
        try:
            loss().backward()
            shadow = self._shadow
        finally:
            self._shadow = None
        return fingerprint(shadow.get(key, gradient_summary(None)) for key in range(self._units))
