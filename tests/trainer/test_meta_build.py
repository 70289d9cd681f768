"""The model built on the meta device, sharded, then given storage and filled
(trainer.parallel.build) holds bitwise the weights of today's seeded eager build,
`torch.manual_seed(seed); GPT(config)`, on every layout: on two real gloo ranks under FSDP
(shard=2, with shards of uneven rows), DDP and TP, for the fused layout with RoPE and SwiGLU and
for the older layout with biases; and the host generator is left where the eager build left it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from infra.processes import free_port
from trainer.model import GPT, GPTConfig
from trainer.parallel import Layout, build, build_mesh

SEED = 11
CONFIGS = {
    # vocab 37: the tied embedding's rows split 19 and 18 under shard=2
    "fused": GPTConfig(vocab_size=37, n_layer=2, n_head=2, n_embd=16, block_size=8, rope=True,
                       swiglu=True, fused_qkv=True, bias=False),
    "older": GPTConfig(vocab_size=37, n_layer=2, n_head=2, n_embd=16, block_size=8),
}  # fmt: skip
LAYOUTS = {"fsdp": Layout(shard=2), "ddp": Layout(replicate=2), "tp": Layout(tensor=2)}


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter (the tied head under both names) and buffer, whole."""
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers()]
    return {name: _whole(tensor) for name, tensor in named}


def _differing(model: torch.nn.Module, eager: torch.nn.Module) -> list[str]:
    built, expected = _tensors(model), _tensors(eager)
    if built.keys() != expected.keys():
        return [f"names: {sorted(built.keys() ^ expected.keys())}"]
    return [name for name, tensor in expected.items() if not torch.equal(built[name], tensor)]


def _rank_main(rank: int, port: int, layout_name: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE="2", LOCAL_RANK=str(rank))  # fmt: skip
    torch.set_num_threads(1)
    layout = LAYOUTS[layout_name]
    placement = build_mesh(layout, "cpu")
    try:
        outcome: dict[str, list[str]] = {}
        for config_name, config in CONFIGS.items():
            model, wrapped = build(config, SEED, layout, placement, torch.device("cpu"))
            after_build = torch.get_rng_state()
            torch.manual_seed(SEED)
            eager = GPT(config)
            differ = _differing(model, eager)
            if not torch.equal(after_build, torch.get_rng_state()):
                differ.append("the host generator's state after the build")
            if model.lm_head.weight is not model.wte.weight:
                differ.append("the head is no longer tied to the embedding")
            if layout.replicate > 1 and wrapped is model:
                differ.append("no DDP wrapper")
            outcome[config_name] = differ
        (Path(out) / f"rank{rank}.json").write_text(json.dumps(outcome))
        # Together: rank 0 serves the rendezvous store, and a rank still talking to it when
        # rank 0's process is gone aborts (SIGABRT in its destroy_process_group).
        dist.barrier()
    except BaseException:
        dist.destroy_process_group()
        raise
    # Out without gloo's teardown: under load it can still abort a rank ("terminate called
    # without an active exception", a thread of its store torn down while the other rank's
    # last message is in flight: seen in a make test on a busy machine). What this test
    # checks is written above; the exit status is all the parent reads of a rank.
    os._exit(0)


@pytest.mark.parametrize("layout_name", list(LAYOUTS))
def test_the_meta_build_holds_the_eager_build_s_weights_bit_for_bit(
    layout_name: str, tmp_path: Path
) -> None:
    mp.start_processes(_rank_main, args=(free_port(), layout_name, str(tmp_path)), nprocs=2,
                       start_method="spawn")  # fmt: skip
    for rank in (0, 1):
        outcome = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert outcome == {"fused": [], "older": []}, (rank, outcome)
