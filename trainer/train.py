"""The torchrun entry point: one process per rank, reads a job file, trains, checkpoints.

    python -m torch.distributed.run ... -m trainer.train JOB.json

It reads top to bottom: set-up, resume, the loop, the final checkpoint. Progress goes to a JSON
lines file that the node agent tails and heartbeats to Temporal.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from infra.store import open_store
from trainer.checkpoint import load_training_state, save_checkpoint
from trainer.data import TokenStream, step_batch
from trainer.job import TrainJob
from trainer.metrics import flops_per_token, mfu
from trainer.model import GPT, GPTConfig
from trainer.schedule import learning_rate


def exit_with_parent(poll_s: float = 0.5) -> None:
    """A rank never outlives its launcher: when torchrun dies (and the agent above it), this
    rank is re-parented, notices, and exits instead of holding a GPU as an orphan."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(poll_s)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


class ProgressFile:
    """Appends one JSON object a line; only each node's local rank 0 writes."""

    def __init__(self, path: str, enabled: bool) -> None:
        self._handle = open(path, "a", buffering=1) if enabled else None  # noqa: SIM115

    def write(self, **event: object) -> None:
        if self._handle is not None:
            self._handle.write(json.dumps({"time": time.time(), **event}) + "\n")


def stop_requested(stop_file: Path | None) -> bool:
    """True on every rank once any node's agent has asked its ranks to stop (a collective)."""
    asked = torch.tensor([int(stop_file is not None and stop_file.exists())])
    dist.all_reduce(asked, op=dist.ReduceOp.MAX)
    return bool(asked.item())


def main(job_path: str) -> None:
    exit_with_parent()
    job = TrainJob.read(Path(job_path))
    cfg = job.train
    torch.set_num_threads(cfg["threads_per_rank"])
    dist.init_process_group("gloo", timeout=timedelta(minutes=5))
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    progress = ProgressFile(job.progress_file, enabled=local_rank == 0)
    store = open_store(job.store_url)
    stop_file = Path(job.stop_file) if job.stop_file else None

    model_config = GPTConfig(**job.model)
    torch.manual_seed(cfg["seed"])  # same initial weights on every rank
    model = GPT(model_config)
    optimizer = model.optimizer(cfg["learning_rate"], cfg["weight_decay"])
    ddp = DistributedDataParallel(model)
    stream = TokenStream([Path(p) for p in job.train_shards], job.dtype, model_config.block_size)

    step, tokens_seen, loss_history = 0, 0, []
    if job.resume is not None:
        load_training_state(ddp, optimizer, Path(job.resume.folder))
        step, tokens_seen = job.resume.step, job.resume.tokens_seen
        loss_history = list(job.resume.loss_history)
    start_step = step
    progress.write(event="started", step=step, rank=rank, world=world)

    total_steps = cfg["steps"]
    tokens_per_step = cfg["batch_size"] * model_config.block_size
    flops_tok = flops_per_token(model_config, model.num_params())
    last_committed: int | None = job.resume.step if job.resume else None
    window_start, window_steps = time.perf_counter(), 0
    while step < total_steps:
        lr = learning_rate(
            step, cfg["learning_rate"], cfg["min_lr"], cfg["warmup_steps"], total_steps
        )
        for group in optimizer.param_groups:
            group["lr"] = lr
        # Randomness (dropout) derives from (seed, step, rank): nothing to save for exact resume.
        torch.manual_seed(cfg["seed"] + 1_000_003 * (step + 1) + rank)
        x, y = step_batch(stream, cfg["seed"], step, cfg["batch_size"], rank, world)
        _, loss = ddp(x, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if cfg["grad_clip"] > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["grad_clip"])
        optimizer.step()
        step += 1
        tokens_seen += tokens_per_step
        window_steps += 1

        # The first step of a (re)start is always reported: it marks when recovery paid off.
        on_grid = step % cfg["log_every"] == 0 or step == total_steps
        if on_grid or step == start_step + 1:
            mean_loss = loss.detach().clone()
            dist.all_reduce(mean_loss, op=dist.ReduceOp.AVG)
            elapsed = time.perf_counter() - window_start
            tokens_per_s = window_steps * tokens_per_step / elapsed
            if on_grid:  # the same points whether or not the run was ever restarted
                loss_history.append([step, mean_loss.item()])
            progress.write(
                event="step",
                step=step,
                total_steps=total_steps,
                loss=mean_loss.item(),
                lr=lr,
                tokens_per_s=tokens_per_s,
                mfu=mfu(tokens_per_s, flops_tok, cfg["peak_flops_per_gpu"], world),
                checkpoint_step=last_committed,
            )
            window_start, window_steps = time.perf_counter(), 0

        # Asked to stop (preemption, drain): every rank must agree, then checkpoint and exit.
        stop = stop_requested(stop_file)
        if stop or step % cfg["checkpoint_every"] == 0 or step == total_steps:
            started = time.perf_counter()
            key = save_checkpoint(
                model=ddp,
                optimizer=optimizer,
                store=store,
                staging_dir=Path(job.staging_dir),
                run_id=job.run_id,
                step=step,
                keep=cfg["keep_checkpoints"],
                meta={
                    "generation": job.generation,
                    "tokens_seen": tokens_seen,
                    "epoch": 0,
                    "data_cursor": {"kind": "seeded-step", "seed": cfg["seed"], "step": step},
                    "rng": "derived from (seed, step, rank) at every step",
                    "model_config": model_config.to_dict(),
                    "train_config": cfg,
                    "loss_history": loss_history,
                    **job.lineage,
                },
            )
            last_committed = step
            progress.write(
                event="checkpoint",
                step=step,
                manifest_key=key,
                seconds=time.perf_counter() - started,
            )
            window_start = time.perf_counter()  # the save is not training throughput
        if stop:
            progress.write(event="stopped", step=step, tokens_seen=tokens_seen)
            dist.destroy_process_group()
            return

    progress.write(event="done", step=step, tokens_seen=tokens_seen)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
