"""The torchrun entry point: one process per rank, reads a job file, trains, checkpoints.

    python -m torch.distributed.run ... -m trainer.train JOB.json

It reads top to bottom: set-up, resume, the loop, the final checkpoint. Progress goes to a JSON
lines file that the node agent tails and heartbeats to Temporal.
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_model as load_safetensors
from torch.nn.parallel import DistributedDataParallel

from infra.store import open_store
from trainer import runtime
from trainer.attempt_clock import AttemptClock
from trainer.checkpoint import Checkpointer, SaveReport, load_model_weights, load_training_state
from trainer.checkpoint_policy import CheckpointPolicy
from trainer.data import RankSlice, Sampler, TokenStream
from trainer.evaluate import held_out_loss
from trainer.grad_watch import PreReduceNorms, suspects
from trainer.job import TrainJob
from trainer.metrics import flops_per_token, mfu
from trainer.model import GPT, GPTConfig
from trainer.parallel import Layout, build_mesh, clip_grad_norm, local_grad_norm, parallelize
from trainer.schedule import learning_rate
from trainer.stragglers import StragglerWatch


class ProgressFile:
    """Appends one JSON object a line; only each node's local rank 0 writes."""

    def __init__(self, path: str, enabled: bool) -> None:
        self._handle = open(path, "a", buffering=1) if enabled else None  # noqa: SIM115

    def write(self, **event: object) -> None:
        if self._handle is not None:
            self._handle.write(json.dumps({"time": time.time(), **event}) + "\n")


def layout_of(job: TrainJob, world: int) -> Layout:
    if not job.layout:
        return Layout(replicate=world)
    return Layout(**{k: job.layout[k] for k in ("replicate", "shard", "tensor")})


def init_weights(model: GPT, source: str) -> None:
    """Fine-tuning starts from another model's weights (the optimizer starts fresh)."""
    path = Path(source)
    if path.is_dir():  # a verified checkpoint folder
        load_model_weights(model, path)
    else:  # a registered model's safetensors weights
        load_safetensors(model, str(path))


# Why a rank wants to stop, in increasing precedence: the largest wins across the gang.
# A straggler verdict needs no vote: every rank reaches it from the same shared times.
KEEP_GOING, ASKED_TO_STOP, PREEMPTED, FENCED, NON_FINITE = 0, 1, 2, 3, 4
STRAGGLER = ASKED_TO_STOP
# Exit status of ranks that found non-finite numbers: the attempt fails and the run resumes
# from the last committed checkpoint, which holds none of them.
EXIT_NON_FINITE = 3
STOP_REASONS = {ASKED_TO_STOP: "asked to stop", PREEMPTED: "preempted", FENCED: "fenced"}


@dataclass(frozen=True)
class StepShare:
    stop: int  # the strongest stop request of any rank
    save: bool  # rank 0's call on a time- or epoch-based checkpoint, the same on every rank
    step_s: list[float]  # every rank's step time
    grad_norm: list[float]  # every rank's local gradient norm
    forward_s: list[float]  # every rank's forward time: its own speed (trainer.stragglers)


def share_step(
    stop: int, save: bool, step_s: float, grad_norm: float, forward_s: float
) -> StepShare:
    """One small all-gather per step, for what the ranks must agree on and what the health
    checks compare across ranks."""
    mine = torch.tensor(
        [float(stop), float(save), step_s, grad_norm, forward_s], dtype=torch.float64
    )
    everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    table = torch.stack(everyone)  # (world, 5)
    return StepShare(
        stop=int(table[:, 0].max()),
        save=bool(table[0, 1]),
        step_s=table[:, 2].tolist(),
        grad_norm=table[:, 3].tolist(),
        forward_s=table[:, 4].tolist(),
    )


def chaos_asks_to_corrupt(chaos_file: Path | None) -> bool:
    """`forgeline chaos corrupt-grad` wrote its file: poison this rank's gradients once, as a
    flipped bit in a GPU's memory would, so detection and rollback can be seen working."""
    if chaos_file is None or not chaos_file.exists():
        return False
    chaos_file.unlink(missing_ok=True)
    return True


def corrupt_gradients(model: torch.nn.Module) -> None:
    grad = next(p.grad for p in model.parameters() if p.grad is not None)
    grad.view(-1)[0] = float("nan")


def main(job_path: str) -> None:
    process_started_at = time.time()
    job = TrainJob.read(Path(job_path))
    cfg = job.train
    torch.set_num_threads(cfg["threads_per_rank"])
    rt = runtime.start(job.node_index, cfg.get("collective_timeout_s", 300))
    term = runtime.TermSignal()
    progress = ProgressFile(job.progress_file, enabled=rt.local_rank == 0)
    store = open_store(job.store_url, twin=job.twin_store_url)
    stop_file = Path(job.stop_file) if job.stop_file else None
    chaos_file = Path(job.chaos_file) if job.chaos_file else None

    # Model: the same initial weights on every rank, then split as the layout says.
    layout = layout_of(job, rt.world)
    placement = build_mesh(layout, rt.device.type)
    model_config = GPTConfig(**job.model)
    torch.manual_seed(cfg["seed"])
    model = GPT(model_config)
    if job.init_weights and job.resume is None:
        init_weights(model, job.init_weights)
    model.to(rt.device)
    wrapped = parallelize(model, layout, placement)
    # Data-parallel replicas: each one's own gradient norm, before the all-reduce mixes them.
    corrupt_next = chaos_file if rt.local_rank == 0 else None
    own_norms = (
        PreReduceNorms(
            wrapped,
            placement.mesh.get_group("replicate"),
            poison_now=lambda: chaos_asks_to_corrupt(corrupt_next),
        )
        if isinstance(wrapped, DistributedDataParallel)
        else None
    )
    if rt.is_cuda:
        wrapped = torch.compile(wrapped)
    optimizer = model.optimizer(cfg["learning_rate"], cfg["weight_decay"])

    # Data: each data-parallel rank reads its slice of every global batch.
    stream = TokenStream([Path(p) for p in job.train_shards], job.dtype, model_config.block_size)
    micro = cfg.get("grad_accum_steps", 1)
    sampler = Sampler(
        stream,
        cfg["seed"],
        cfg["batch_size"],
        RankSlice(placement.dp_rank, placement.dp_size, micro),
    )
    val_stream = (
        TokenStream([Path(p) for p in job.val_shards], job.dtype, model_config.block_size)
        if job.val_shards and cfg.get("eval_every", 0)
        else None
    )
    sample_log = open(job.sample_log, "a", buffering=1) if job.sample_log else None  # noqa: SIM115

    step, tokens_seen, loss_history = 0, 0, []
    samples_seen = 0
    load_started = time.perf_counter()
    if job.resume is not None:
        load_training_state(wrapped, optimizer, Path(job.resume.folder))
        step, tokens_seen = job.resume.step, job.resume.tokens_seen
        loss_history = list(job.resume.loss_history)
        samples_seen = job.resume.samples_seen
        if samples_seen is None:
            samples_seen = step * cfg["batch_size"]
    start_step = step
    load_s = time.perf_counter() - load_started
    checkpointer = Checkpointer(
        store=store,
        staging_dir=Path(job.staging_dir),
        run_id=job.run_id,
        generation=job.generation,
        keep=cfg["keep_checkpoints"],
        layout=layout.to_dict(),
        asynchronous=cfg.get("async_checkpoint", True),
    )
    progress.write(
        event="started", step=step, rank=rt.rank, world=rt.world, layout=layout.to_dict()
    )
    clock = AttemptClock(
        store, job.run_id, job.generation, start_step, process_started_at, enabled=rt.rank == 0
    )
    clock.ready(load_s)
    settings = job.stragglers.get("watch", {"window": 20, "factor": 1.5, "windows": 3})
    stragglers = StragglerWatch(**settings)
    straggler_action = job.stragglers.get("policy", "report")
    straggler_reason = ""

    total_steps = cfg["steps"]
    tokens_per_step = cfg["batch_size"] * model_config.block_size
    flops_tok = flops_per_token(model_config, model.num_params())
    last_committed: int | None = job.resume.step if job.resume else None
    window_start, window_steps = time.perf_counter(), 0
    policy = CheckpointPolicy.from_train_config(cfg, job.mtbf_s)
    last_save_at = time.monotonic()
    last_costs: tuple[float | None, float | None] = (None, None)  # stall, commit seconds

    def report_commit(report: SaveReport | None) -> None:
        nonlocal last_committed, last_costs
        if report is None:
            return
        last_costs = (report.stall_s, report.total_s)
        if report.manifest_key is not None:
            last_committed = report.step
            clock.committed(report.step)
        progress.write(
            event="checkpoint",
            step=report.step,
            manifest_key=report.manifest_key,
            seconds=report.total_s,
            stall_s=report.stall_s,
        )

    def checkpoint() -> None:
        nonlocal last_save_at
        last_save_at = time.monotonic()
        clock.save_issued(step)
        previous = checkpointer.save(
            wrapped,
            optimizer,
            step,
            meta={
                "tokens_seen": tokens_seen,
                "samples_seen": samples_seen,
                "epoch": sampler.epoch(samples_seen),
                "data_cursor": {
                    "kind": "epoch-permutation",
                    "seed": cfg["seed"],
                    "samples_seen": samples_seen,
                    "samples_per_epoch": stream.samples,
                },
                "rng": "derived from (seed, step, rank) at every step",
                "model_config": model_config.to_dict(),
                "train_config": cfg,
                "loss_history": loss_history,
                **job.lineage,
            },
        )
        report_commit(previous)  # the save before, which this one had to wait for
        clock.add(stall_s=time.monotonic() - last_save_at)

    ranks_per_node = rt.world // job.nodes

    def report_health(kind: str, rank: int, action: str, evidence: str, **more: object) -> None:
        """A finding about one rank's node, for the node agent to pass to the run."""
        progress.write(
            event="health", kind=kind, step=step, rank=rank,
            node_index=rank // ranks_per_node, action=action, evidence=evidence, **more,
        )  # fmt: skip

    def wait_for_commit() -> None:
        waited = time.perf_counter()
        report_commit(checkpointer.wait())
        clock.add(stall_s=time.perf_counter() - waited)

    while step < total_steps:
        step_started = time.perf_counter()
        # Randomness (dropout) derives from (seed, step, rank): nothing to save for exact resume.
        torch.manual_seed(cfg["seed"] + 1_000_003 * (step + 1) + rt.rank)
        loss_sum = torch.zeros((), device=rt.device)
        forward_s = 0.0
        for indices, x, y in sampler.micro_batches(samples_seen):
            if sample_log is not None:
                sample_log.write(f"{step} {rt.rank} {' '.join(map(str, indices.tolist()))}\n")
            forward_started = time.perf_counter()
            with rt.autocast():
                _, loss = wrapped(x.to(rt.device), y.to(rt.device))
            forward_s += time.perf_counter() - forward_started
            (loss / micro).backward()
            loss_sum += loss.detach() / micro
        if own_norms is None and chaos_asks_to_corrupt(corrupt_next):
            corrupt_gradients(wrapped)  # no all-reduce hook to do it in: after backward
        grad_norm = local_grad_norm(wrapped)
        finite = math.isfinite(grad_norm) and math.isfinite(loss_sum.item())
        if own_norms is not None:
            grad_norm = own_norms.take()  # what the ranks compare: this replica's own
        clip_grad_norm(wrapped, cfg["grad_clip"])
        # The weights change here: a checkpoint being staged must have its copy first.
        stall_started = time.perf_counter()
        checkpointer.before_weights_change()
        stall_s = time.perf_counter() - stall_started
        lr = learning_rate(
            step, cfg["learning_rate"], cfg["min_lr"], cfg["warmup_steps"], total_steps
        )
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        samples_seen += cfg["batch_size"]
        tokens_seen += tokens_per_step
        window_steps += 1
        report_commit(checkpointer.poll())

        if not finite:  # silent corruption or divergence: nothing from here on may be saved
            asked = NON_FINITE
        elif checkpointer.fenced:  # a later generation owns the run now: commit nothing more
            asked = FENCED
        elif term.received:
            asked = PREEMPTED
        elif stop_file is not None and stop_file.exists():
            asked = ASKED_TO_STOP
        else:
            asked = KEEP_GOING
        # Time and epoch boundaries are rank 0's call, so every rank saves at the same step.
        save_due = rt.rank == 0 and policy.due(
            step,
            time.monotonic() - last_save_at,
            epoch_ended=sampler.epoch(samples_seen)
            > sampler.epoch(samples_seen - cfg["batch_size"]),
            stall_s=last_costs[0],
            commit_s=last_costs[1],
        )
        step_s = time.perf_counter() - step_started
        shared = share_step(asked, save_due, step_s, grad_norm, forward_s)
        stop = shared.stop
        lost_before = stragglers.lost_s
        straggler = stragglers.add(step, shared.forward_s, step_s - stall_s)
        clock.step_done(
            step,
            train_s=step_s - stall_s,
            stall_s=stall_s,
            straggler_s=stragglers.lost_s - lost_before,
        )
        if straggler is not None and straggler_action != "off":
            straggler_reason = straggler.describe(ranks_per_node)
            report_health("straggler", straggler.rank, straggler_action, straggler_reason,
                          ratio=straggler.ratio)  # fmt: skip
            if straggler_action == "swap":  # checkpoint now; the run continues without it
                stop = max(stop, STRAGGLER)
        if stop == NON_FINITE:
            bad = suspects(shared.grad_norm)
            for rank in bad:  # the whole gang saw NaN; these ranks made it
                norm = shared.grad_norm[rank]
                what = "non-finite" if not math.isfinite(norm) else f"far larger ({norm:.3g})"
                report_health(
                    "corruption", rank, "quarantine",
                    f"rank {rank}'s own gradients were {what} before the all-reduce at step "
                    f"{step} (norms by rank: {shared.grad_norm})",
                )  # fmt: skip
            clock.end("failed: non-finite loss or gradients")
            progress.write(
                event="failed",
                step=step,
                reason=f"non-finite loss or gradients at step {step} "
                f"({f'suspect ranks {bad}' if bad else 'on every rank: divergence?'}): "
                "rolling back to the last committed checkpoint",
            )
            checkpointer.close()  # a save in flight was staged before this step: let it commit
            dist.destroy_process_group()
            sys.exit(EXIT_NON_FINITE)

        # The first step of a (re)start is always reported: it marks when recovery paid off.
        on_grid = step % cfg["log_every"] == 0 or step == total_steps
        if on_grid or step == start_step + 1:
            # Each tensor-parallel rank holds the same loss; averaging over all ranks is exact.
            mean_loss = loss_sum.clone()
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
                mfu=mfu(tokens_per_s, flops_tok, cfg["peak_flops_per_gpu"], rt.world),
                checkpoint_step=last_committed,
                epoch=sampler.epoch(samples_seen),
                rank_step_s=shared.step_s,
                rank_grad_norm=shared.grad_norm,
            )
            window_start, window_steps = time.perf_counter(), 0

        if val_stream is not None and step % cfg["eval_every"] == 0:
            eval_started = time.perf_counter()
            wrapped.eval()
            val_loss, val_tokens = held_out_loss(
                wrapped, val_stream, cfg["batch_size"] // placement.dp_size, cfg["eval_batches"],
                part=(placement.dp_rank, placement.dp_size),
            )  # fmt: skip
            wrapped.train()
            progress.write(event="eval", step=step, val_loss=val_loss, val_tokens=val_tokens)
            clock.add(eval_s=time.perf_counter() - eval_started)
            window_start = time.perf_counter()  # evaluation is not training throughput

        if stop == FENCED:
            # A save that straddled the fence may still report; it goes before the stop, so
            # "stopped" is the last word of this generation.
            wait_for_commit()
            clock.end("stopped: fenced")
            progress.write(event="stopped", step=step, tokens_seen=tokens_seen, reason="fenced")
            break
        if stop or shared.save or step == total_steps:
            checkpoint()
        if stop:
            wait_for_commit()  # a stop is only safe once the commit landed
            if checkpointer.fenced:
                reason = STOP_REASONS[FENCED]
            elif straggler_reason and stop == STRAGGLER and straggler_action == "swap":
                reason = f"straggler: {straggler_reason}"
            else:
                reason = STOP_REASONS[stop]
            clock.end(f"stopped: {reason}")
            progress.write(event="stopped", step=step, tokens_seen=tokens_seen, reason=reason)
            break

    wait_for_commit()
    checkpointer.close()
    if step >= total_steps:
        clock.end("done")
        progress.write(event="done", step=step, tokens_seen=tokens_seen)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
