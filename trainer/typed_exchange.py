"""Ranks exchange small records as typed JSON, never as pickles.

`dist.all_gather_object` and `broadcast_object_list` pickle what they send and unpickle what
they receive: whatever reaches a rank's gloo connections (they are not authenticated) would run
as code in it. Forgeline's own exchanges (a checkpoint's files and verdicts, the peer tier's
inventories) carry plain records, so they go as JSON bytes in a uint8 tensor and are parsed into
their declared type (pydantic's TypeAdapter): anything else is refused as malformed.
"""

from __future__ import annotations

from typing import Any, TypeVar

import torch
import torch.distributed as dist
from pydantic import TypeAdapter

T = TypeVar("T")
# A record a rank sends in one exchange: a checkpoint's file list for one rank is far smaller.
MAX_BYTES = 64 * 2**20


def all_gather_typed(value: T, kind: Any, group: dist.ProcessGroup | None = None) -> list[T]:
    """Every rank's `value`, in rank order, each parsed as `kind` (a type TypeAdapter takes)."""
    adapter = TypeAdapter(kind)
    data = adapter.dump_json(value)
    if len(data) > MAX_BYTES:
        raise ValueError(f"a record of {len(data)} bytes is over the exchange's {MAX_BYTES}")
    device = _device(group)
    world = dist.get_world_size(group)
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    longest = max(int(s.item()) for s in sizes)
    if longest > MAX_BYTES:
        raise ValueError(f"a rank sends a record of {longest} bytes, over {MAX_BYTES}")
    mine = torch.zeros(longest, dtype=torch.uint8, device=device)
    mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    received = [torch.zeros(longest, dtype=torch.uint8, device=device) for _ in range(world)]
    dist.all_gather(received, mine, group=group)
    return [
        adapter.validate_json(bytes(buffer[: int(n.item())].cpu().numpy()))
        for buffer, n in zip(received, sizes, strict=True)
    ]


def broadcast_typed(value: T | None, kind: Any, src: int, group: dist.ProcessGroup | None) -> T:
    """`src`'s `value` on every rank (`src` is a rank of the default group), parsed as `kind`."""
    gathered = all_gather_typed(value, kind | None, group)
    source = dist.get_group_rank(group, src) if group is not None else src
    picked = gathered[source]
    assert picked is not None, f"rank {src} sent nothing to broadcast"
    return picked


def _device(group: dist.ProcessGroup | None) -> torch.device:
    """NCCL moves CUDA tensors only; gloo, host memory."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
