"""What each rank stages for a checkpoint under data parallelism alone (trainer.checkpoint_staging):
its share of the state every rank holds, so a node copies the state about once, not once a
rank. That the checkpoint reads back whole, bit for bit, is shown by the DDP resume tests
(test_distributed_training, test_layouts)."""

from __future__ import annotations

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict

from trainer.checkpoint_staging import own_share
from trainer.model import GPT, GPTConfig


def _state() -> dict:
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=65))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.zeros(1, 16, dtype=torch.long), torch.zeros(1, 16, dtype=torch.long))[1].backward()
    optimizer.step()
    return {"model": model.state_dict(), "optim": optimizer.state_dict()}


def _tensor_bytes(part: dict) -> int:
    return sum(v.nbytes for v in part.values() if isinstance(v, torch.Tensor))


def test_each_rank_stages_a_share_and_together_they_hold_every_tensor_once() -> None:
    state = _state()
    flat, _ = flatten_state_dict(state)
    whole = _tensor_bytes(flat)
    for world in (2, 8):
        shares = [own_share(state, rank, world) for rank in range(world)]
        tensors = [{k for k, v in s.items() if isinstance(v, torch.Tensor)} for s in shares]
        assert set().union(*tensors) == {k for k, v in flat.items() if isinstance(v, torch.Tensor)}
        assert sum(len(t) for t in tensors) == len(set().union(*tensors))  # each once
        biggest = max(v.nbytes for v in flat.values() if isinstance(v, torch.Tensor))
        # Balanced: no rank stages more than an even part plus one tensor.
        assert max(_tensor_bytes(s) for s in shares) <= whole / world + biggest
        # The optimizer's settings (not tensors) stay with every rank, as DCP expects.
        others = {k for k, v in flat.items() if not isinstance(v, torch.Tensor)}
        assert all(others <= set(s) for s in shares)


def test_every_rank_computes_the_same_split() -> None:
    first, again = _state(), _state()
    assert own_share(first, 1, 4).keys() == own_share(again, 1, 4).keys()
