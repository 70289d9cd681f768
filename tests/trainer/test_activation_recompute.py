"""Activation recomputation in one process: the recomputed blocks train bitwise as blocks that
keep their activations (dropout included), really run their forward again in backward, keep
their parameter names, and refuse what cannot work with the reason."""

from __future__ import annotations

from typing import get_args

import pytest
import torch

from trainer.activation_recompute import MODES, RecomputeError, recompute, recomputed_mode
from trainer.model import GPT, GPTConfig
from workflows.contracts.spec import ParallelSpec

CONFIG = GPTConfig(
    vocab_size=64, n_layer=3, n_head=2, n_embd=32, block_size=16, dropout=0.1,
    rope=True, swiglu=True, fused_qkv=True, bias=False,
)  # fmt: skip


def trained(mode: str, steps: int = 3) -> tuple[GPT, list[float], int]:
    """The model after `steps` AdamW steps, its losses, and how often its MLPs ran forward."""
    torch.manual_seed(0)
    model = GPT(CONFIG)
    recompute(model.blocks, mode)
    calls = 0

    def count(*_: object) -> None:
        nonlocal calls
        calls += 1

    for block in model.blocks:
        block.mlp.register_forward_hook(count)
    optimizer = model.optimizer(1e-2, 0.1)
    losses = []
    for step in range(steps):
        torch.manual_seed(100 + step)  # as trainer.rng_streams seeds each step
        x, y = torch.randint(0, 64, (2, 4, 16))
        _, loss = model(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return model, losses, calls


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_recomputed_blocks_train_bitwise_as_kept_ones(mode: str) -> None:
    kept, kept_losses, kept_calls = trained("none")
    ours, losses, calls = trained(mode)
    assert losses == kept_losses
    mine = ours.state_dict()
    for name, theirs in kept.state_dict().items():
        assert torch.equal(theirs, mine[name]), name
    # Each block's forward ran again in its backward: the recompute happened.
    assert kept_calls == 3 * CONFIG.n_layer
    assert calls == 2 * kept_calls
    assert list(ours.state_dict()) == list(kept.state_dict())
    assert {recomputed_mode(block) for block in ours.blocks} == {mode}


def test_evaluation_runs_the_forward_once() -> None:
    torch.manual_seed(0)
    model = GPT(CONFIG).eval()
    recompute(model.blocks, "full")
    with torch.no_grad():
        logits, _ = model(torch.randint(0, 64, (2, 16)))
    assert logits.shape == (2, 16, 64)


def test_a_block_given_twice_or_an_unknown_mode_is_refused() -> None:
    model = GPT(CONFIG)
    with pytest.raises(RecomputeError, match="choose one of"):
        recompute(model.blocks, "some")
    assert recompute(model.blocks, "none") == 0
    assert recompute(model.blocks, "full") == CONFIG.n_layer
    with pytest.raises(RecomputeError, match="recomputed already"):
        recompute(model.blocks[:1], "selective")
    with pytest.raises(RecomputeError, match="not a torch module"):
        recompute([lambda x: x], "full")  # type: ignore[list-item]


def test_the_spec_offers_the_modes_the_rank_knows() -> None:
    field = ParallelSpec.model_fields["activation_checkpointing"]
    assert get_args(field.annotation) == MODES
