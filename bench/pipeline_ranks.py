"""The measured side of bench.pipeline: one layout's training steps on torchrun's ranks, or one
recomputation mode's peak memory and step time in one process. Writes JSON to --out (rank 0).

    python -m torch.distributed.run --nproc-per-node 2 -m bench.pipeline_ranks --layout pp ...
    python -m bench.pipeline_ranks --recompute selective --out m.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from trainer.activation_recompute import recompute
from trainer.gpt_stages import build_stages, stage_loss
from trainer.model import GPT, GPTConfig, adamw
from trainer.parallel import Layout, build, build_mesh
from trainer.pipeline import Pipeline, PipelineSettings

VOCAB = 256


def _batch(batch: int, block: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, VOCAB, (batch, block + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def layout_steps(args: argparse.Namespace) -> dict:
    """Step times of the GPT under DDP over the ranks, or as a pipeline of as many stages."""
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    world = dist.get_world_size()
    config = GPTConfig(VOCAB, args.layers, 4, args.width, args.block, fused_qkv=True, bias=False)
    device = torch.device("cpu")
    if args.layout == "pp":
        layout = Layout(pipeline=world)
        settings = PipelineSettings(world, "1F1B", 1, args.microbatches)
        placement = build_mesh(layout, "cpu")
        staged = build_stages(config, 0, layout, placement, device, settings)
        pipeline = Pipeline(staged.parts, settings, placement.mesh, device, stage_loss,
                            staged.tied)  # fmt: skip
        model = staged.module
        local = args.batch
    else:
        layout = Layout(replicate=world)
        placement = build_mesh(layout, "cpu")
        model, wrapped = build(config, 0, layout, placement, device)
        local = args.batch // world
    optimizer = adamw(model, 1e-3, 0.1)
    times = []
    for step in range(args.warmup + args.steps):
        x, y = _batch(args.batch, args.block, step)
        if args.layout == "ddp":
            mine = slice(dist.get_rank() * local, (dist.get_rank() + 1) * local)
            x, y = x[mine], y[mine]
        dist.barrier()
        started = time.perf_counter()
        if args.layout == "pp":
            pipeline.step(x, y)
        else:
            _, loss = wrapped(x, y)
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        dist.barrier()
        if step >= args.warmup:
            times.append(time.perf_counter() - started)
    result = {"layout": args.layout, "step_s": statistics.median(times), "world": world}
    if args.layout == "pp":
        result["solo_s"] = _solo_stage(staged, pipeline, args, config)
    dist.destroy_process_group()
    return result


def _solo_stage(staged, pipeline: Pipeline, args: argparse.Namespace, config: GPTConfig) -> float:
    """The slowest stage's forward and backward of the step's micro-batches alone, with no
    neighbour to wait for: the work a rank would do with no bubble."""
    micro = args.batch // args.microbatches
    part = staged.parts[0]
    times = []
    for step in range(args.steps):
        x, y = _batch(micro, args.block, step)
        started = time.perf_counter()
        for _ in range(args.microbatches):
            if pipeline.first:
                out = part(x)
            else:
                hidden = torch.randn(micro, args.block, config.n_embd, requires_grad=True)
                out = part(hidden)
            if pipeline.last:
                stage_loss(out, y).backward()
            else:
                out.backward(torch.ones_like(out) * 1e-3)
        times.append(time.perf_counter() - started)
    staged.module.zero_grad(set_to_none=True)
    mine = torch.tensor(statistics.median(times))
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    return float(mine)


def recompute_step(args: argparse.Namespace) -> dict:
    """Peak memory a forward and backward adds, and the step time, under one mode."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = GPTConfig(VOCAB, args.layers, 4, args.width, args.block, dropout=0.1,
                       fused_qkv=True, bias=False)  # fmt: skip
    model = GPT(config)
    recompute(model.blocks, args.recompute)
    optimizer = adamw(model, 1e-3, 0.1)
    # The gradients and AdamW's moments made without a forward, so the high-water mark before
    # the steps holds every state but the activations.
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times = []
    for step in range(args.steps):
        x, y = _batch(args.batch, args.block, step)
        started = time.perf_counter()
        _, loss = model(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        times.append(time.perf_counter() - started)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"mode": args.recompute, "peak_added_mib": (peak - before) / 1024,
            "step_s": statistics.median(times)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layout", choices=("pp", "ddp"))
    parser.add_argument("--recompute", choices=("none", "selective", "full"))
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--block", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    result = layout_steps(args) if args.layout else recompute_step(args)
    if args.recompute or int(os.environ.get("RANK", "0")) == 0:
        args.out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
