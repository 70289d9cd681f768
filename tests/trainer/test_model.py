import copy
import dataclasses
import itertools
import math

import pytest
import torch
from torch import nn

from trainer.metrics import flops_per_token, mfu
from trainer.model import (
    GPT,
    GPTConfig,
    apply_rotary,
    mlp_hidden,
    rotary_tables,
    stored_layout,
)
from trainer.schedule import learning_rate
from workflows.contracts.spec import ModelSpec

CONFIG = GPTConfig(vocab_size=50, n_layer=2, n_head=2, n_embd=32, block_size=16)


def test_forward_shapes_and_initial_loss() -> None:
    torch.manual_seed(0)
    model = GPT(CONFIG)
    x, y = torch.randint(0, 50, (2, 4, 16))  # (B, T) each
    logits, loss = model(x, y)
    assert logits.shape == (4, 16, 50)  # (B, T, V)
    # GPT-2 init predicts close to uniform: the loss starts near ln(V).
    assert abs(loss.item() - math.log(50)) < 0.1


LAYOUTS = [
    pytest.param(rope, swiglu, id=f"rope={rope}-swiglu={swiglu}")
    for rope, swiglu in itertools.product([False, True], repeat=2)
]


# How the weights are laid out: what new runs get (the spec's default), and what every
# checkpoint made before holds (GPTConfig's default, for configs stored without the keys).
WEIGHTS = [
    pytest.param(True, False, id="fused-qkv-no-bias"),
    pytest.param(False, True, id="separate-qkv-biases"),
]


@pytest.mark.parametrize(("rope", "swiglu"), LAYOUTS)
@pytest.mark.parametrize(("fused_qkv", "bias"), WEIGHTS)
def test_learns_a_fixed_batch(rope: bool, swiglu: bool, fused_qkv: bool, bias: bool) -> None:
    torch.manual_seed(0)
    config = dataclasses.replace(CONFIG, rope=rope, swiglu=swiglu, fused_qkv=fused_qkv, bias=bias)
    model = GPT(config)
    optimizer = model.optimizer(learning_rate=3e-3, weight_decay=0.0)
    x = torch.randint(0, 50, (8, 16))
    losses = []
    for _ in range(100):
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


def test_config_round_trips_and_old_keys_still_work() -> None:
    config = GPTConfig(vocab_size=50, n_head=2, n_embd=32, rope=True, swiglu=True, rope_theta=500.0)
    assert GPTConfig(**config.to_dict()) == config
    old = GPTConfig(**{"vocab_size": 50, "n_layer": 1, "n_head": 2, "n_embd": 32})
    assert not old.rope and not old.swiglu


def test_rope_swiglu_layout() -> None:
    torch.manual_seed(0)
    model = GPT(dataclasses.replace(CONFIG, rope=True, swiglu=True))
    x, y = torch.randint(0, 50, (2, 4, 16))  # (B, T) each
    logits, loss = model(x, y)
    assert logits.shape == (4, 16, 50)
    assert abs(loss.item() - math.log(50)) < 0.1
    assert model.wpe is None
    keys = set(model.state_dict())
    assert {"blocks.0.attn.q.weight", "blocks.0.attn.k.bias", "blocks.0.mlp.gate.weight"} <= keys
    assert not any("wpe" in key or "qkv" in key for key in keys)
    # The rope tables exist as buffers but are not saved.
    buffers = {name for name, _ in model.named_buffers()}
    assert {"blocks.0.attn.rotary.cos", "blocks.0.attn.rotary.sin"} <= buffers
    assert not any("rotary" in key for key in keys)
    assert model.blocks[0].mlp.gate.weight.shape == (96, 32)  # (hidden, C)
    # No position table: every parameter is a non-embedding one.
    assert model.num_params() == model.num_params(non_embedding=False)


def test_mlp_hidden_size_rule() -> None:
    assert mlp_hidden(32, swiglu=False) == 128
    assert mlp_hidden(32, swiglu=True) == 96  # 8·32/3 = 85.3 -> 96
    assert mlp_hidden(768, swiglu=True) == 2048  # exact: 8·768/3
    for n_embd in range(1, 300):
        hidden = mlp_hidden(n_embd, swiglu=True)
        assert hidden % 16 == 0 and 8 * n_embd / 3 <= hidden < 8 * n_embd / 3 + 16


def test_bad_config_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"n_embd \(30\).*n_head \(4\)"):
        GPTConfig(vocab_size=50, n_head=4, n_embd=30)
    with pytest.raises(ValueError, match="even head dim"):
        GPTConfig(vocab_size=50, n_head=4, n_embd=12, rope=True)  # head dim 3
    GPTConfig(vocab_size=50, n_head=4, n_embd=12)  # odd head dim is fine without rope


def test_rope_scores_depend_only_on_relative_position() -> None:
    torch.manual_seed(0)
    head_dim, n_pos = 16, 64
    cos, sin = rotary_tables(head_dim, n_pos, theta=10000.0)  # (n_pos, D) each
    q, k = torch.randn(2, head_dim)

    def score(m: int, n: int) -> torch.Tensor:
        """q at position m dotted with k at position n, after rotation."""
        return apply_rotary(q, cos[m], sin[m]) @ apply_rotary(k, cos[n], sin[n])

    for m, n, shift in [(3, 1, 7), (0, 5, 20), (10, 10, 40)]:
        torch.testing.assert_close(score(m, n), score(m + shift, n + shift))
    # It is a rotation (norms kept), and it does encode position: the offset changes the score.
    torch.testing.assert_close(apply_rotary(q, cos[9], sin[9]).norm(), q.norm())
    assert not torch.allclose(score(3, 1), score(3, 2), atol=1e-3)
    torch.testing.assert_close(apply_rotary(q, cos[0], sin[0]), q)  # position 0: identity


def column_shard(linear: nn.Linear, rank: int, tp: int) -> nn.Linear:
    """This rank's output rows (and bias) of a column-parallel Linear."""
    weight = linear.weight.detach().chunk(tp, dim=0)[rank]  # (out/tp, in)
    part = nn.Linear(weight.shape[1], weight.shape[0], bias=linear.bias is not None)
    with torch.no_grad():
        part.weight.copy_(weight)
        if linear.bias is not None:
            part.bias.copy_(linear.bias.detach().chunk(tp)[rank])
    return part


def row_shard(linear: nn.Linear, rank: int, tp: int) -> nn.Linear:
    """This rank's input columns of a row-parallel Linear; the bias is added by rank 0 only."""
    weight = linear.weight.detach().chunk(tp, dim=1)[rank]  # (out, in/tp)
    part = nn.Linear(weight.shape[1], weight.shape[0], bias=linear.bias is not None)
    with torch.no_grad():
        part.weight.copy_(weight)
        if linear.bias is not None:
            bias = linear.bias.detach()
            part.bias.copy_(bias if rank == 0 else torch.zeros_like(bias))
    return part


def tensor_parallel(module: nn.Module, columns: list[str], tp: int) -> list[nn.Module]:
    """Emulated shards of module: columns split by output rows, proj by input columns."""
    shards = []
    for rank in range(tp):
        shard = copy.deepcopy(module)
        for name in columns:
            setattr(shard, name, column_shard(getattr(module, name), rank, tp))
        shard.proj = row_shard(module.proj, rank, tp)
        shards.append(shard)
    return shards


@pytest.mark.parametrize(("rope", "swiglu"), LAYOUTS)
@pytest.mark.parametrize(("fused_qkv", "bias"), WEIGHTS)
def test_tensor_parallel_shards_sum_to_the_full_block(
    rope: bool, swiglu: bool, fused_qkv: bool, bias: bool
) -> None:
    torch.manual_seed(0)
    config = dataclasses.replace(
        CONFIG, n_head=4, rope=rope, swiglu=swiglu, fused_qkv=fused_qkv, bias=bias
    )
    block = GPT(config).blocks[0].eval()
    for module in (block.attn, block.mlp):  # random biases so bias handling is checked too
        for linear in module.children():
            if isinstance(linear, nn.Linear) and linear.bias is not None:
                nn.init.normal_(linear.bias)
    x = torch.randn(3, 16, 32)  # (B, T, C)
    # qkv's rows are grouped by head, so plain chunks of its rows are whole heads' q, k and v.
    attn_shards = tensor_parallel(block.attn, ["qkv"] if fused_qkv else ["q", "k", "v"], tp=2)
    mlp_shards = tensor_parallel(block.mlp, ["fc", "gate"] if swiglu else ["fc"], tp=2)
    with torch.no_grad():
        # Each attention shard runs its own forward on 2 of the 4 heads (C/2 channels) ...
        first = attn_shards[0]
        width = first.qkv(x).shape[-1] // 3 if fused_qkv else first.q(x).shape[-1]
        assert width == 16
        # ... and the all-reduce that follows the row-parallel proj is a sum.
        torch.testing.assert_close(
            sum(shard(x) for shard in attn_shards), block.attn(x), atol=1e-5, rtol=1e-5
        )
        torch.testing.assert_close(
            sum(shard(x) for shard in mlp_shards), block.mlp(x), atol=1e-5, rtol=1e-5
        )


def test_a_config_stored_before_the_fused_layout_means_the_old_weights() -> None:
    old = {"vocab_size": 50, "n_layer": 1, "n_head": 2, "n_embd": 32}  # no layout keys
    assert stored_layout(old) == {"fused_qkv": False, "bias": True}
    keys = set(GPT(GPTConfig(**old)).state_dict())
    assert {"blocks.0.attn.q.weight", "blocks.0.attn.q.bias", "ln_f.bias"} <= keys
    new = GPTConfig(**{**old, "fused_qkv": True, "bias": False})
    assert stored_layout(new.to_dict()) == {"fused_qkv": True, "bias": False}
    keys = set(GPT(new).state_dict())
    assert "blocks.0.attn.qkv.weight" in keys and not any(k.endswith(".bias") for k in keys)
    assert GPT(new).blocks[0].attn.qkv.weight.shape == (96, 32)  # (H·3·D, C)
    # New runs get the fused layout from the spec.
    assert stored_layout(ModelSpec().architecture()) == {"fused_qkv": True, "bias": False}
