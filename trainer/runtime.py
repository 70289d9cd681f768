"""What a rank needs from its process before it trains: device, process group, signals.

Kept apart from the loop so `train.py` reads as training, not as plumbing.
"""

from __future__ import annotations

import contextlib
import os
import resource
import signal
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from infra.parent_death import die_with_parent_from_now
from trainer.device_env import DEVICE_VARIABLE


class TermSignal:
    """SIGTERM (a preemption notice from the launcher, the scheduler or the machine) sets a flag
    the loop checks once per step, so the step in progress finishes and a checkpoint commits."""

    def __init__(self) -> None:
        self.received = False
        signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum: int, frame: object) -> None:
        self.received = True


@dataclass(frozen=True)
class Runtime:
    device: torch.device
    rank: int
    world: int
    local_rank: int

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def autocast(self) -> contextlib.AbstractContextManager:
        return autocast_for(self.device)


def autocast_for(device: torch.device) -> contextlib.AbstractContextManager:
    """The one precision policy, for ranks and for processes that are none (the control
    worker's evaluation): bf16 autocast on GPUs; full precision on CPU, where bf16 matmuls are
    slower."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def start(node_index: int, collective_timeout_s: int) -> Runtime:
    """Join the process group with a rank fixed by the allocation's node order.

    torchrun's c10d rendezvous numbers nodes by arrival, so the node that happens to start first
    would become rank 0. The rank here is node index × ranks per node + local rank instead, so
    rank order (and with it tensor-parallel groups and data slices) never depends on timing.
    """
    # A rank never outlives its launcher: when torchrun dies (its node agent died), the rank is
    # killed at once, before it trains another step with peers that still answer.
    die_with_parent_from_now()
    _raise_file_limit()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = node_index * per_node + local_rank
    device = _device(local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        backend = "cpu:gloo,cuda:nccl"  # gloo for checkpoint collectives, NCCL for training
    else:
        backend = "gloo"
    dist.init_process_group(
        backend,
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=collective_timeout_s),
        # With its GPU named, NCCL connects at once, where a fault shows before the first step,
        # and every subgroup of the mesh is split from that communicator instead of opening
        # its own lazily at its first collective.
        device_id=device if device.type == "cuda" else None,
    )
    return Runtime(device=device, rank=rank, world=world, local_rank=local_rank)


def _raise_file_limit() -> None:
    """Up to the hard limit: a rank holds a socket for each peer it exchanges with in each
    process group (gloo's, NCCL's bootstrap), and distributions' soft default (1,024) is
    below what a gang of a few hundred ranks needs."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _device(local_rank: int) -> torch.device:
    """This rank's GPU (the `local_rank`-th its job was shown: trainer.device_env), or the CPU
    on a node without GPUs. On a GPU node (its agent says so) a rank that sees no GPU is on a
    broken node: it fails in words that say so (trainer.platform_faults), instead of training
    on the CPU a hundred times slower without anyone noticing."""
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank)
    if os.environ.get(DEVICE_VARIABLE) == "cuda":
        raise RuntimeError(
            "no CUDA-capable device is visible to this rank on a GPU node "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '')!r}): its driver "
            "or GPUs are broken; the node is taken out of service"
        )
    return torch.device("cpu")
