"""Activation recomputation ("activation checkpointing"): a block keeps less of its forward for
backward and computes the rest again there, trading compute for memory.

Two modes, as the spec's `parallel.activation_checkpointing` names them:

- `full`: a block keeps only its inputs; its whole forward runs again in backward. Activations
  held fall from every layer's to one layer's input per layer plus one layer's working set, for
  about a third more compute (a second forward of every block).
- `selective`: a block keeps the outputs of the operations that cost FLOPs or traffic (matrix
  products, attention, tensor-parallel collectives) and recomputes the cheap ones around them
  (norms, activation functions, dropout, residual adds): most of the memory those take, for
  almost no compute.

The block's forward is replaced on the instance, never wrapped in another module, so its
parameters keep their names: a checkpoint is the same set of names with recomputation or
without, and a run may turn it on or off between attempts.

Recomputation draws the same dropout masks as the forward did. torch's checkpoint keeps the
default generator's state and draws from it again; the tensor-parallel ranks' sharded stream
(`trainer.rng_streams`) is kept by `ShardedReplay`. A random operation is never one whose
output is kept: not drawn again in the recompute, it would shift every later draw there.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Literal, get_args

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from trainer.rng_streams import ShardedReplay

Mode = Literal["none", "full", "selective"]
MODES: tuple[str, ...] = get_args(Mode)

# What `selective` keeps: the outputs whose recomputation would cost FLOPs (products,
# attention) or a collective (tensor parallelism's reductions). Everything else is recomputed.
_aten = torch.ops.aten
_KEPT = {
    _aten.mm.default,
    _aten.addmm.default,
    _aten.bmm.default,
    _aten.baddbmm.default,
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops._c10d_functional.all_reduce.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
}
_MARK = "_forgeline_recompute"  # set on a block whose forward is replaced


class RecomputeError(ValueError):
    """A block given twice, or a mode that does not exist; the message names which."""


def recompute(blocks: Iterable[nn.Module], mode: str) -> int:
    """Recompute each of `blocks` in backward as `mode` says ("none": leave them); returns how
    many blocks it changed. Each block must be called with its inputs as arguments (what the
    recompute starts from) and be a module of its own (a transformer layer)."""
    if mode not in MODES:
        raise RecomputeError(f"activation checkpointing {mode!r}: choose one of {MODES}")
    if mode == "none":
        return 0
    count = 0
    for block in blocks:
        if not isinstance(block, nn.Module):
            raise RecomputeError(f"{type(block).__name__} is not a torch module: pass the blocks")
        if getattr(block, _MARK, None):
            raise RecomputeError(
                f"{type(block).__name__} is recomputed already: give each block once"
            )
        # On the instance: nn.Module.__call__ calls self.forward, so hooks (FSDP's, tensor
        # parallelism's) still run around it, and the state dict's names do not change.
        block.forward = functools.partial(_recomputed, block.forward, mode)
        object.__setattr__(block, _MARK, mode)
        count += 1
    return count


def recomputed_mode(block: nn.Module) -> str:
    return getattr(block, _MARK, None) or "none"


def _recomputed(forward: Callable[..., Any], mode: str, *args: Any, **kwargs: Any) -> Any:
    if not torch.is_grad_enabled():  # evaluation: nothing to keep, nothing to recompute
        return forward(*args, **kwargs)
    context = _full_contexts if mode == "full" else _selective_contexts
    return checkpoint(forward, *args, use_reentrant=False, context_fn=context, **kwargs)


def _full_contexts() -> tuple[contextlib.AbstractContextManager, ...]:
    replay = ShardedReplay()
    return replay.noted(), replay.replayed()


def _selective_contexts() -> tuple[contextlib.AbstractContextManager, ...]:
    replay = ShardedReplay()
    keep, again = create_selective_checkpoint_contexts(_policy)
    return _both(replay.noted(), keep), _both(replay.replayed(), again)


@contextlib.contextmanager
def _both(
    first: contextlib.AbstractContextManager, second: contextlib.AbstractContextManager
) -> Iterator[None]:
    with first, second:
        yield


def _policy(_ctx: object, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    if op in _KEPT and not _draws(op, args, kwargs):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _draws(op: Any, args: tuple, kwargs: dict) -> bool:
    """Whether this call of `op` takes random numbers: a seeded op (attention) draws only where
    its dropout is on."""
    if torch.Tag.nondeterministic_seeded not in op.tags:
        return False
    for index, argument in enumerate(op._schema.arguments):
        if argument.name == "dropout_p":
            value = args[index] if index < len(args) else kwargs.get("dropout_p", 0.0)
            return bool(value)
    return True
