"""What a rank copies out of its training state for a checkpoint, and when (trainer.checkpoint's
first stage).

Three rules:

- **Off the loop.** The copy runs in the background and the loop waits for it only before the
  next `optimizer.step()`, the first moment the weights change. On CPU a thread copies
  (`BackgroundCopyStager`: torch's DefaultStager copies synchronously there); on a GPU torch's
  DefaultStager copies into pinned host memory on a stream of its own.
- **After the step that made it.** A GPU runs the script's kernels later than the script calls
  them, and the stager's stream does not wait for the compute stream: a checkpoint taken right
  after `optimizer.step()`, with no synchronize in between, would copy weights half from before
  the step and half from after. `ComputeOrderedStager` makes the copies wait for the work queued
  on the compute stream when the save was called, and nothing later.
- **Each rank its share.** Under data parallelism alone every rank holds the whole state, and
  DCP writes each tensor once, from one rank, but only after every rank has staged all of it:
  eight ranks of a node copying a 1.1 B-parameter model with AdamW (about 13 GB each) into pinned
  memory would nearly fill a 128 GB host. `own_share` gives each rank its part of the tensors
  (balanced by bytes, the same split on every rank) before staging, so a node stages the state
  about once. What it writes is the same checkpoint: the same keys, read back whole by any
  layout.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions


def _copy(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_copy(v) for v in value)
    return value


class BackgroundCopyStager:
    """DCP's AsyncStager protocol: copy the state in a thread; the loop decides when to wait.

    torch's DefaultStager copies synchronously on CPU (its async staging needs CUDA), which would
    block training for the whole copy; this one returns at once.
    """

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-stage")

    @property
    def should_synchronize_after_execute(self) -> bool:
        return False

    def stage(self, state_dict: dict) -> Future:
        return self._pool.submit(_copy, state_dict)

    def synchronize_staging(self) -> None:  # part of the protocol; the loop waits on the future
        pass

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class ComputeOrderedStager(DefaultStager):
    """torch's DefaultStager (pinned memory, its own stream, non-blocking copies), whose copies
    start only once the work the compute stream had queued when `stage` was called is done."""

    def stage(self, state_dict: dict, **kwargs: Any) -> Any:
        # Recorded here, on the calling thread's current stream: the script's compute stream.
        queued = torch.Event()
        queued.record()
        return super().stage(state_dict, _after=queued, **kwargs)

    def _stage(self, state_dict: dict, _after: torch.Event | None = None, **kwargs: Any) -> Any:
        if _after is not None:
            if self._staging_stream is not None:
                self._staging_stream.wait_event(_after)
            else:
                _after.synchronize()
        return super()._stage(state_dict, **kwargs)


def stager_for(cuda: bool) -> BackgroundCopyStager | DefaultStager:
    if cuda:  # device-to-host copies into pinned memory, overlapped with compute
        return ComputeOrderedStager(
            StagingOptions(
                use_pinned_memory=True,
                use_shared_memory=False,
                use_async_staging=True,
                use_non_blocking_copy=True,
            )
        )
    return BackgroundCopyStager()


def own_share(state: dict, rank: int, world: int) -> dict:
    """This rank's part of a state every rank holds whole (data parallelism alone), flattened
    as DCP flattens it: every plain tensor goes to one rank, the biggest first to the rank
    with the fewest bytes so far (ties: the lowest rank), so every rank computes the same
    split; everything else (the optimizer's settings) stays with every rank, as DCP expects.
    DCP reads a checkpoint by these flattened names whatever shape the reader's state has."""
    flat, _ = flatten_state_dict(state)
    # A DTensor is a subclass: a shard of a sharded layout, which is its rank's alone already.
    tensors = [(k, v) for k, v in flat.items() if type(v) is torch.Tensor]
    tensors.sort(key=lambda item: (-item[1].nbytes, item[0]))
    loads = [0] * world
    owner: dict[str, int] = {}
    for key, tensor in tensors:
        least = min(range(world), key=lambda r: (loads[r], r))
        owner[key] = least
        loads[least] += tensor.nbytes
    return {k: v for k, v in flat.items() if owner.get(k, rank) == rank}
