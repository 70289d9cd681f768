"""The declared parallel layout: how a gang's ranks split the model and the data.

Three degrees, as in torchtitan, whose product is the world size:

- `replicate`: data-parallel replicas. Alone, plain DDP; with `shard`, HSDP (shard inside a
  replica group, all-reduce across them).
- `shard`: fully sharded data parallel (FSDP2 `fully_shard`, ZeRO-3): parameters, gradients and
  optimizer moments are split across these ranks and gathered per block for compute.
- `tensor`: tensor parallel inside each block (`parallelize_module`): attention heads and MLP
  columns split across these ranks, the output projections reduce.

The mesh is (replicate, shard, tensor), tensor innermost so a tensor-parallel group sits on
consecutive ranks, which are the GPUs of one node.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)
from torch.nn.parallel import DistributedDataParallel

from trainer.model import GPT
from trainer.rng_streams import sharded_draws

MESH_DIMS = ("replicate", "shard", "tensor")


@dataclass(frozen=True)
class Layout:
    replicate: int = 1
    shard: int = 1
    tensor: int = 1

    @property
    def world_size(self) -> int:
        return self.replicate * self.shard * self.tensor

    @property
    def data_parallel(self) -> int:
        """Ranks that read different data (a tensor-parallel group reads the same)."""
        return self.replicate * self.shard

    @property
    def strategy(self) -> str:
        parts = []
        if self.shard > 1:
            parts.append("hsdp" if self.replicate > 1 else "fsdp")
        elif self.replicate > 1:
            parts.append("ddp")
        if self.tensor > 1:
            parts.append("tp")
        return "+".join(parts) or "single"

    def to_dict(self) -> dict:
        return {**asdict(self), "strategy": self.strategy, "world_size": self.world_size}


@dataclass(frozen=True)
class Placement:
    """This rank's coordinates in the layout."""

    mesh: DeviceMesh
    dp_rank: int  # which slice of each global batch this rank reads
    dp_size: int


@dataclass(frozen=True)
class Precision:
    """How a device type trains: what FSDP casts its collectives to, and which AdamW runs."""

    fsdp: MixedPrecisionPolicy
    fused_adamw: bool | None  # None: torch's default (the for-loop AdamW on CPU)


def precision_for(device_type: str) -> Precision:
    """On GPUs, FSDP gathers parameters in bf16 (half the bytes of each all-gather, and the
    dtype autocast computes in anyway) and reduce-scatters gradients in fp32 (bf16 sums lose
    the small updates); AdamW is the fused CUDA kernel, one launch for every parameter. On
    CPU nothing changes: FSDP's default policy (no casts) and the for-loop AdamW, the path
    whose bitwise-exact resume is tested."""
    if device_type == "cuda":
        return Precision(
            MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32), True
        )
    return Precision(MixedPrecisionPolicy(), None)


def build_mesh(layout: Layout, device_type: str) -> Placement:
    mesh = init_device_mesh(
        device_type, (layout.replicate, layout.shard, layout.tensor), mesh_dim_names=MESH_DIMS
    )
    replicate_rank = mesh.get_local_rank("replicate")
    shard_rank = mesh.get_local_rank("shard")
    return Placement(mesh, replicate_rank * layout.shard + shard_rank, layout.data_parallel)


def _tensor_parallel(model: GPT, mesh: DeviceMesh) -> None:
    """Split each block: qkv and the MLP's input projections by columns (whole heads: qkv's
    rows are grouped by head), the output projections by rows, so each block costs one
    all-reduce in forward and one in backward."""
    attention = ("attn.qkv",) if model.config.fused_qkv else ("attn.q", "attn.k", "attn.v")
    for block in model.blocks:
        plan = {
            **{name: ColwiseParallel() for name in attention},
            "attn.proj": RowwiseParallel(),
            "mlp.fc": ColwiseParallel(),
            "mlp.proj": RowwiseParallel(),
        }
        if model.config.swiglu:
            plan["mlp.gate"] = ColwiseParallel()
        parallelize_module(block, mesh, plan)
        block.attn.head_draws = sharded_draws  # its heads are this rank's alone


def parallelize(model: GPT, layout: Layout, placement: Placement) -> nn.Module:
    """Apply the layout in place where possible; returns the module the loop calls."""
    mesh = placement.mesh
    if layout.tensor > 1:
        _tensor_parallel(model, mesh["tensor"])
    if layout.shard > 1 or (layout.tensor > 1 and layout.data_parallel > 1):
        dp_mesh = mesh["replicate", "shard"] if layout.replicate > 1 else mesh["shard"]
        policy = precision_for(mesh.device_type).fsdp
        # One unit per block so only one block's full weights exist at a time; the root unit
        # holds the embeddings (tied with the head) and the final norm.
        for block in model.blocks:
            fully_shard(block, mesh=dp_mesh, mp_policy=policy)
        fully_shard(model, mesh=dp_mesh, mp_policy=policy)
        return model
    if layout.replicate > 1:
        return DistributedDataParallel(model, process_group=mesh.get_group("replicate"))
    return model


def local_grad_norm(model: torch.nn.Module) -> tuple[float, bool]:
    """The L2 norm of the gradients this rank holds (its shards under FSDP or TP): a health
    signal, compared across ranks to spot silent corruption; and whether those gradients are
    whole (no DTensor shards: one rank, or DDP after its all-reduce), in which case the norm is
    also the global one that clipping needs. One foreach norm and one copy to the host, where a
    loop over the parameters costs several operations each (and, on a GPU, a sync each). The
    squares are summed in float32, as a sum over every element would be: the norm is inf when
    that sum overflows, NaN when any gradient holds a NaN."""
    grads = []
    whole = True
    for param in model.parameters():
        grad = param.grad
        if grad is not None:
            if hasattr(grad, "to_local"):
                grad, whole = grad.to_local(), False
            grads.append(grad)
    if not grads:
        return 0.0, whole
    with torch.no_grad():
        norms = torch._foreach_norm(grads, 2, dtype=torch.float32)
        try:
            stacked = torch.stack(norms)
        except RuntimeError:  # gradients on more than one device (CPU offload)
            stacked = torch.stack([n.cpu() for n in norms])
        return float(stacked.square().sum().sqrt()), whole


def clip_grad_norm(model: nn.Module, max_norm: float, total: float | None = None) -> float:
    """Clip all gradients by their global norm and return it (before clipping). `total` is
    that norm when the caller already has it (`local_grad_norm` of whole gradients): taking it
    again would be a second pass over every gradient each step.

    torch's clip_grad_norm_ needs every gradient to be a plain tensor or every one a DTensor on
    one mesh; under tensor parallelism the blocks' gradients are DTensors while the embeddings'
    are not (or live on another mesh). So norms are taken per group of like gradients, each
    group's reduced to a plain number, then combined.
    """
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if total is None:
        groups: dict[object, list[torch.Tensor]] = {}
        for grad in grads:
            groups.setdefault(getattr(grad, "device_mesh", None), []).append(grad)
        squares = torch.zeros((), dtype=torch.float64)
        for members in groups.values():
            norm = torch.nn.utils.get_total_norm(members, 2.0)
            if hasattr(norm, "full_tensor"):  # a DTensor: partial over its shards until reduced
                norm = norm.full_tensor()
            squares += norm.detach().double().cpu() ** 2
        total = float(squares.sqrt())
    if max_norm > 0 and total > max_norm:
        coef = max_norm / (total + 1e-6)
        plain = [g for g in grads if not hasattr(g, "device_mesh")]
        if plain:  # one foreach multiply where the gradients allow it
            torch._foreach_mul_(plain, coef)
        for grad in grads:
            if hasattr(grad, "device_mesh"):
                grad.mul_(coef)
    return total
