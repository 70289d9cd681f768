"""The declared parallel layout: how a gang's ranks split the model and the data.

Four degrees, as in torchtitan, whose product is the world size:

- `pipeline`: pipeline stages, the model's layers split in order (`trainer.pipeline`; the
  built-in GPT's stages: `trainer.gpt_stages`).

- `replicate`: data-parallel replicas. Alone, plain DDP; with `shard`, HSDP (shard inside a
  replica group, all-reduce across them).
- `shard`: fully sharded data parallel (FSDP2 `fully_shard`, ZeRO-3): parameters, gradients and
  optimizer moments are split across these ranks and gathered per block for compute.
- `tensor`: tensor parallel inside each block (`parallelize_module`): attention heads and MLP
  columns split across these ranks, the output projections reduce.

The mesh is (pipeline, replicate, shard, tensor), tensor innermost so a tensor-parallel group
sits on consecutive ranks, which are the GPUs of one node, and pipeline outermost: a stage's
ranks hold the same layers, and only activations of one micro-batch cross between stages.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)
from torch.nn.parallel import DistributedDataParallel
from torch.utils._python_dispatch import TorchDispatchMode

from trainer.model import GPT, GPTConfig, Rotary
from trainer.pipeline import Pipeline
from trainer.rng_streams import sharded_draws

MESH_DIMS = ("pipeline", "replicate", "shard", "tensor")


class MetaBuildError(RuntimeError):
    """The model cannot be built on the meta device and filled bitwise as the eager build
    fills it: an initialization the recorder does not know, or a parameter never initialized.
    The message names it; the fix is in this module's tables, not the model."""


@dataclass(frozen=True)
class Layout:
    replicate: int = 1
    shard: int = 1
    tensor: int = 1
    pipeline: int = 1

    @classmethod
    def from_job(cls, layout: dict) -> Layout:
        """The degrees of a job file's layout (a job from before pipelines has none: 1)."""
        return cls(**{k: int(layout[k]) for k in ("replicate", "shard", "tensor", "pipeline")
                      if k in layout})  # fmt: skip

    @property
    def world_size(self) -> int:
        return self.pipeline * self.replicate * self.shard * self.tensor

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
        if self.pipeline > 1:
            parts.append("pp")
        return "+".join(parts) or "single"

    def to_dict(self) -> dict:
        """As manifests record it; `pipeline` only where there is one (as before pipelines)."""
        degrees = asdict(self)
        if self.pipeline == 1:
            del degrees["pipeline"]
        return {**degrees, "strategy": self.strategy, "world_size": self.world_size}


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
    shape = (layout.pipeline, layout.replicate, layout.shard, layout.tensor)
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIMS)
    replicate_rank = mesh.get_local_rank("replicate")
    shard_rank = mesh.get_local_rank("shard")
    return Placement(mesh, replicate_rank * layout.shard + shard_rank, layout.data_parallel)


def blocks_of(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of a GPT or of a pipeline stage of one (`trainer.gpt_stages`)."""
    blocks = model.blocks  # type: ignore[union-attr]
    return list(blocks.values()) if isinstance(blocks, nn.ModuleDict) else list(blocks)


def _tensor_parallel(model: nn.Module, mesh: DeviceMesh) -> None:
    """Split each block: qkv and the MLP's input projections by columns (whole heads: qkv's
    rows are grouped by head), the output projections by rows, so each block costs one
    all-reduce in forward and one in backward."""
    attention = ("attn.qkv",) if model.config.fused_qkv else ("attn.q", "attn.k", "attn.v")
    for block in blocks_of(model):
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
    shard_in_place(model, layout, placement.mesh)
    return replicated(model, layout, placement.mesh)


def _sharded(layout: Layout) -> bool:
    return layout.shard > 1 or (layout.tensor > 1 and layout.data_parallel > 1)


def shard_in_place(
    model: nn.Module, layout: Layout, mesh: DeviceMesh, roots: list[nn.Module] | None = None
) -> None:
    """Tensor parallelism and FSDP, in place: both work on a model of the meta device.
    `roots`: the modules whose FSDP unit holds what no block does (a pipeline's stages, each
    a root of its own); the model itself by default."""
    if layout.tensor > 1:
        _tensor_parallel(model, mesh["tensor"])
    if _sharded(layout):
        dp_mesh = mesh["replicate", "shard"] if layout.replicate > 1 else mesh["shard"]
        policy = precision_for(mesh.device_type).fsdp
        # One unit per block so only one block's full weights exist at a time; the root unit
        # holds the embeddings (tied with the head) and the final norm.
        for block in blocks_of(model):
            fully_shard(block, mesh=dp_mesh, mp_policy=policy)
        for root in roots or [model]:
            fully_shard(root, mesh=dp_mesh, mp_policy=policy)


def replicated(model: nn.Module, layout: Layout, mesh: DeviceMesh) -> nn.Module:
    """DDP where the layout is plain data parallel (it needs the weights: it broadcasts them)."""
    if layout.replicate > 1 and not _sharded(layout):
        return DistributedDataParallel(model, process_group=mesh.get_group("replicate"))
    return model


# ---- building on the meta device -------------------------------------------------------
#
# An eager build makes every weight on the host, on every rank, before any is sharded: out
# of host memory from about 7 B parameters. Built on the meta device, a model holds no
# storage; it is sharded there, given storage on the run's device (`to_empty`), and filled.
# The weights must be bitwise those of `torch.manual_seed(seed); GPT(config)`: exact resume
# and every checkpoint's lineage start from them. They are a function of the host
# generator's state at each parameter's last initialization, which depends on every draw
# before it (constructors draw, `_init_weights` draws again). So the meta build still makes
# each draw, on a host tensor of one parameter's shape dropped at once, and keeps for each
# parameter only its last initialization and the generator state before it; filling replays
# that one parameter at a time and keeps this rank's shard. Host memory: the largest single
# parameter, never the model.

# The in-place initializations GPT's construction makes (nn.init and reset_parameters).
_RANDOM_INITS = {torch.ops.aten.uniform_.default, torch.ops.aten.normal_.default}
_CONSTANT_INITS = {torch.ops.aten.fill_.Scalar, torch.ops.aten.zero_.default}


@dataclass(frozen=True)
class _Init:
    """One tensor's last initialization, replayable on the host alone."""

    op: Callable[..., torch.Tensor]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    shape: torch.Size
    dtype: torch.dtype
    rng_state: torch.Tensor | None  # the host generator before a random init

    def replay(self) -> torch.Tensor:
        out = torch.empty(self.shape, dtype=self.dtype, device="cpu")
        kwargs = dict(self.kwargs)
        if self.rng_state is not None:
            generator = torch.Generator()
            generator.set_state(self.rng_state)
            kwargs["generator"] = generator
        self.op(out, *self.args, **kwargs)
        return out


class _InitRecorder(TorchDispatchMode):
    """While a model is built on the meta device: each initialization of a meta tensor is also
    made on a host tensor of its shape (the host generator advances as in an eager build), and
    the last one of each tensor is kept."""

    def __init__(self) -> None:
        super().__init__()
        # id -> (the tensor, held so no later tensor takes its id; its last initialization)
        self.inits: dict[int, tuple[torch.Tensor, _Init]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # torch's signature
        kwargs = kwargs or {}
        target = args[0] if args else None
        if isinstance(target, torch.Tensor) and target.is_meta:
            if func in _RANDOM_INITS or func in _CONSTANT_INITS:
                self.inits[id(target)] = (target, self._made(func, target, args[1:], kwargs))
            elif _in_place(func):
                raise MetaBuildError(
                    f"{func} on a meta tensor while building the model: trainer.parallel's "
                    "meta build cannot replay it; add it to _RANDOM_INITS or _CONSTANT_INITS"
                )
        return func(*args, **kwargs)

    @staticmethod
    def _made(func, target: torch.Tensor, args: tuple, kwargs: dict) -> _Init:
        """The initialization, made once on the host now: a random one draws what the eager
        build draws here, from the generator state it records."""
        random = func in _RANDOM_INITS
        state = torch.get_rng_state() if random else None
        init = _Init(func, tuple(args), kwargs, target.shape, target.dtype, state)
        if random:
            func(torch.empty(target.shape, dtype=target.dtype, device="cpu"), *args, **kwargs)
        return init

    def by_name(self, model: nn.Module) -> dict[str, _Init]:
        inits = {}
        for name, param in model.named_parameters():
            if id(param) not in self.inits:
                raise MetaBuildError(f"{name} was never initialized while the model was built")
            inits[name] = self.inits[id(param)][1]
        return inits


def _in_place(func: Callable[..., Any]) -> bool:
    """An aten op that writes its first argument (`uniform_`, `copy_`, ...)."""
    return func._schema.name.endswith("_")


@torch.no_grad()
def fill(
    model: nn.Module,
    inits: dict[str, _Init],
    device: torch.device,
    parts: list[nn.Module] | None = None,
) -> None:
    """Storage on `device` for this rank's part of every weight, filled as an eager build
    fills it; the rotary tables, which are computed, computed again. `parts`: the FSDP roots
    that hold the model's parameters between them (a pipeline's stages), given storage each
    through its own root; the model itself by default."""
    for part in parts or [model]:
        part.to_empty(device=device)
        part.tie_weights()  # type: ignore[operator]  # to_empty leaves a plain parameter untied
    model.tie_weights()  # type: ignore[operator]
    for name, param in model.named_parameters():
        full = inits[name].replay()
        if isinstance(param, DTensor):
            # Every rank holds the same full tensor, so each cuts its own shard: no traffic.
            mine = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
            param.to_local().copy_(mine.to_local())
        else:
            param.copy_(full)
        del full
    for module in model.modules():
        if isinstance(module, Rotary):
            module.reset_tables()


def build(
    config: GPTConfig, seed: int, layout: Layout, placement: Placement, device: torch.device
) -> tuple[GPT, nn.Module]:
    """The GPT with the seeded initial weights, split as the layout says, without ever holding
    the whole model on the host: (the model, the module the loop calls)."""
    model, inits = built_on_meta(config, seed)
    shard_in_place(model, layout, placement.mesh)
    fill(model, inits, device)
    return model, replicated(model, layout, placement.mesh)


def built_on_meta(config: GPTConfig, seed: int) -> tuple[GPT, dict[str, _Init]]:
    """The GPT on the meta device, and each parameter's initialization as the eager build of
    `torch.manual_seed(seed); GPT(config)` makes it, to replay once it has storage."""
    torch.manual_seed(seed)
    recorder = _InitRecorder()
    with recorder, torch.device("meta"):
        model = GPT(config)
    return model, recorder.by_name(model)


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


def clip_grad_norm(
    model: nn.Module,
    max_norm: float,
    total: float | None = None,
    pipeline: Pipeline | None = None,
) -> float:
    """Clip all gradients by their global norm and return it (before clipping). `total` is
    that norm when the caller already has it (`local_grad_norm` of whole gradients): taking it
    again would be a second pass over every gradient each step.

    torch's clip_grad_norm_ needs every gradient to be a plain tensor or every one a DTensor on
    one mesh; under tensor parallelism the blocks' gradients are DTensors while the embeddings'
    are not (or live on another mesh). So norms are taken per group of like gradients, each
    group's reduced to a plain number, then combined. Under a pipeline (`pipeline`), a rank
    holds its stages' gradients only: the squares are summed over the pipeline's ranks, a
    weight both the first and last stage hold counted once.
    """
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if total is None:
        skipped = pipeline.counted_elsewhere if pipeline is not None else set()
        counted = [
            p.grad for p in model.parameters() if p.grad is not None and id(p) not in skipped
        ]
        groups: dict[object, list[torch.Tensor]] = {}
        for grad in counted:
            groups.setdefault(getattr(grad, "device_mesh", None), []).append(grad)
        squares = torch.zeros((), dtype=torch.float64)
        for members in groups.values():
            norm = torch.nn.utils.get_total_norm(members, 2.0)
            if hasattr(norm, "full_tensor"):  # a DTensor: partial over its shards until reduced
                norm = norm.full_tensor()
            squares += norm.detach().double().cpu() ** 2
        if pipeline is not None:
            squares = pipeline.summed(squares)
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
