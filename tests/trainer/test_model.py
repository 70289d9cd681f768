import itertools
import math

import pytest
import torch

from trainer.metrics import flops_per_token, mfu
from trainer.model import GPT, GPTConfig
from trainer.schedule import learning_rate

CONFIG = GPTConfig(vocab_size=50, n_layer=2, n_head=2, n_embd=32, block_size=16)


def test_forward_shapes_and_initial_loss() -> None:
    torch.manual_seed(0)
    model = GPT(CONFIG)
    x, y = torch.randint(0, 50, (2, 4, 16))  # (B, T) each
    logits, loss = model(x, y)
    assert logits.shape == (4, 16, 50)  # (B, T, V)
    # GPT-2 init predicts close to uniform: the loss starts near ln(V).
    assert abs(loss.item() - math.log(50)) < 0.1


def test_learns_a_fixed_batch() -> None:
    torch.manual_seed(0)
    model = GPT(CONFIG)
    optimizer = model.optimizer(learning_rate=3e-3, weight_decay=0.0)
    x = torch.randint(0, 50, (8, 16))
    losses = []
    for _ in range(60):
        _, loss = model(x[:, :-1], x[:, 1:])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


def test_tied_embeddings_and_generation() -> None:
    model = GPT(CONFIG)
    assert model.lm_head.weight is model.wte.weight
    out = model.generate(torch.zeros((1, 3), dtype=torch.long), max_new_tokens=20)
    assert out.shape == (1, 23)
    with pytest.raises(ValueError, match="exceeds block_size"):
        model(torch.zeros((1, 17), dtype=torch.long))


def test_flops_and_mfu() -> None:
    n = GPT(CONFIG).num_params()
    per_token = flops_per_token(CONFIG, n)
    assert per_token == 6 * n + 12 * 2 * 2 * 16 * 16
    assert mfu(1000.0, per_token, peak_flops_per_device=per_token * 1000.0, devices=2) == 0.5


def test_learning_rate_schedule() -> None:
    lrs = [learning_rate(s, 1.0, 0.1, warmup=10, total=100) for s in range(101)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in itertools.pairwise(lrs[10:]))
    assert lrs[100] == pytest.approx(0.1)
