"""Dropout under tensor parallelism, on two real gloo ranks: a tensor-parallel group draws the
same masks where it holds the same values (the residual stream), so its copies of the
activations and of the replicated weights stay identical; its heads draw masks of their own."""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import forgeline
from infra.processes import free_port
from trainer.model import GPT, GPTConfig
from trainer.parallel import Layout, build_mesh, parallelize
from trainer.rng_streams import seed_step, step_seed

CONFIG = GPTConfig(vocab_size=64, n_layer=2, n_head=4, n_embd=32, block_size=16, dropout=0.1)
SEED, STEPS = 7, 3


def _train_tp(rank: int, port: int, out: str, by_global_rank: bool) -> None:
    """One rank of a tensor-parallel pair: three steps of training with dropout, seeded as the
    SDK seeds a step (or, `by_global_rank`, as it did before: by the global rank). Saves what it
    holds that the group should hold alike: each block's output, the replicated weights."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE="2", LOCAL_RANK=str(rank))  # fmt: skip
    torch.set_num_threads(1)
    device = torch.device("cpu")
    placement = build_mesh(Layout(tensor=2), "cpu")
    torch.manual_seed(SEED)
    model = GPT(CONFIG)
    parallelize(model, Layout(tensor=2), placement)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    outputs: list[torch.Tensor] = []
    for block in model.blocks:
        block.register_forward_hook(lambda _m, _i, out: outputs.append(out.detach().clone()))
    data = torch.Generator().manual_seed(SEED)
    for step in range(1, STEPS + 1):
        coordinate = rank if by_global_rank else placement.dp_rank
        seed_step(device, SEED, step, coordinate, rank, tensor_parallel=True)
        x = torch.randint(0, CONFIG.vocab_size, (4, CONFIG.block_size), generator=data)
        _, loss = model(x, x)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    replicated = {
        name: p.detach().clone()
        for name, p in model.named_parameters()
        if not hasattr(p, "device_mesh")  # not split by the tensor-parallel plan
    }
    torch.save({"outputs": outputs, "replicated": replicated}, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


def _run_pair(tmp_path: Path, by_global_rank: bool) -> tuple[dict, dict]:
    mp.spawn(_train_tp, args=(free_port(), str(tmp_path), by_global_rank), nprocs=2)
    return tuple(torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))  # type: ignore[return-value]


def test_a_tensor_parallel_group_keeps_its_replicated_values_identical(tmp_path: Path) -> None:
    first, second = _run_pair(tmp_path, by_global_rank=False)
    assert len(first["outputs"]) == STEPS * CONFIG.n_layer
    for one, other in zip(first["outputs"], second["outputs"], strict=True):
        assert torch.equal(one, other)
    assert first["replicated"].keys() == second["replicated"].keys() >= {"wte.weight"}
    for name, weight in first["replicated"].items():
        assert torch.equal(weight, second["replicated"][name]), name


def test_seeded_by_the_global_rank_the_copies_drift_apart(tmp_path: Path) -> None:
    """What the rule above prevents: masks drawn per rank on the shared residual stream."""
    first, second = _run_pair(tmp_path, by_global_rank=True)
    assert not torch.equal(first["outputs"][0], second["outputs"][0])
    assert not torch.equal(first["replicated"]["wte.weight"], second["replicated"]["wte.weight"])


def test_each_rank_draws_its_own_masks_for_its_heads_and_the_step_is_unchanged() -> None:
    """The sharded stream differs from rank to rank of a group; drawing from it leaves the
    default stream where it was, so the replicated dropout after it is the group's."""
    cpu = torch.device("cpu")
    draws = {}
    for rank in (0, 1):
        seed_step(cpu, SEED, 5, dp_rank=0, rank=rank, tensor_parallel=True)
        with forgeline.sharded_draws():  # as a user's own rank script would
            heads = torch.rand(8)
        draws[rank] = (heads, torch.rand(8))
    assert not torch.equal(draws[0][0], draws[1][0])
    assert torch.equal(draws[0][1], draws[1][1])
    torch.default_generator.manual_seed(step_seed(SEED, 5, 0))
    assert torch.equal(draws[0][1], torch.rand(8))
