"""The training SDK: what a rank script calls to train on Forgeline.

A rank script is started by torchrun on every rank of a gang. It calls `forgeline.init()` and
gets a `Run`: its rank, world, device and layout; the run's dataset as a deterministic,
resharding sampler; `restore()` from the last committed checkpoint; and `steps()`, the loop
itself. Everything the platform needs from a rank happens inside these calls:

- every step the ranks share one small all-gather (stop requests, step and forward times, each
  rank's own gradient norm), from which the straggler watch and the corruption check judge (a
  gang of one rank takes the same decisions from its own numbers, without the collective);
- checkpoints follow the spec's interval policy (steps, minutes, epochs, `auto`), are saved
  asynchronously (torch.distributed.checkpoint) and committed by a manifest, fenced by the
  allocation's generation;
- stop requests (preemption, drain, a straggler swap, a newer generation) end the loop after a
  checkpoint commits;
- the loop's end is kept whatever the script's loop does: a `break` out of it, an exception in
  it (`forgeline.loop_end`);
- progress goes to the node agent (heartbeats, MLflow) and the goodput ledger to the store.

The script keeps what is its own: the model, the optimizer, the forward and backward pass,
and whatever else it names in `restore(state=...)` (`forgeline.kept_state`): checkpointed and
restored with them.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import sys
import time
from collections.abc import Generator, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from forgeline.errors import SDKUsageError
from forgeline.findings import Findings
from forgeline.kept_state import KeptState
from forgeline.loop_end import LeftLoop
from forgeline.saves import Saves
from forgeline.shadow import ShadowChecks, shadow_checks
from forgeline.step import Step
from forgeline.stops import StopRules
from infra.store.factory import open_store
from trainer import runtime
from trainer.attempt_clock import AttemptClock
from trainer.checkpoint import load_training_state
from trainer.checkpoint_policy import CheckpointPolicy
from trainer.data import RankSlice, Sampler, TokenStream
from trainer.entry import mark_began
from trainer.grad_watch import ChaosPoison, OwnGradients, chaos_order, flip_low_bit
from trainer.job import TrainJob
from trainer.job_checkpoints import checkpointer_for, resolve
from trainer.metrics import mfu
from trainer.own_gradients import own_gradients
from trainer.parallel import Layout, Placement, build_mesh
from trainer.progress import ProgressFile
from trainer.rng_streams import seed_step
from trainer.shadow_check import Recompute, ShadowSettings, Verdict
from trainer.spike_watch import SpikeSettings, SpikeWatch
from trainer.step_share import (
    EXIT_NON_FINITE,
    NO_SAVE,
    PEER_SAVE,
    STORE_SAVE,
    StepShare,
    share_step,
)
from trainer.stop_reasons import FENCED, NON_FINITE
from workflows.contracts.spec import TrainSpec

SERVING_MODULE = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


class Run:
    """This rank's view of a training run. Made by `forgeline.init()`."""

    def __init__(self, job: TrainJob, process_started_at: float) -> None:
        self.job = job
        self.settings = TrainSpec.model_validate(job.train)
        cfg = self.settings
        torch.set_num_threads(cfg.threads_per_rank)
        # Opened before the rendezvous: the node agent must see that this rank waits in the
        # platform's call (a node's business), not in the script's own code (trainer.start_watch).
        self._progress = ProgressFile(
            job.progress_file, enabled=os.environ.get("LOCAL_RANK", "0") == "0"
        )
        self._progress.write(event="sdk", call="init", state="entered")
        rt = runtime.start(job.node_index, cfg.collective_timeout_s)
        self._rt = rt
        self.rank, self.world, self.local_rank = rt.rank, rt.world, rt.local_rank
        self.device = rt.device
        self.nodes = job.nodes
        self.ranks_per_node = rt.world // job.nodes
        self._term = runtime.TermSignal()
        self._process_started_at = process_started_at
        self._findings = Findings(self._progress, self.ranks_per_node)
        self.store = open_store(job.store_url, twin=job.twin_store_url)
        self._stop_file = Path(job.stop_file) if job.stop_file else None
        chaos = Path(job.chaos_file) if job.chaos_file else None
        self._corrupt_next = chaos if rt.local_rank == 0 else None
        self.layout = (
            Layout(**{k: job.layout[k] for k in ("replicate", "shard", "tensor")})
            if job.layout
            else Layout(replicate=rt.world)
        )
        self.placement: Placement = build_mesh(self.layout, rt.device.type)
        self.sampler: Sampler | None = None
        self._sample_log = open(job.sample_log, "a", buffering=1) if job.sample_log else None  # noqa: SIM115
        # Set by restore():
        self.step = 0
        self.tokens_seen = 0
        self.samples_seen = 0
        self.loss_history: list[list[float]] = []  # [step, mean loss] on the log grid
        self._model: torch.nn.Module | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._kept: KeptState | None = None  # restore(state=...)
        self._own_norms: OwnGradients | None = None
        self._shadow = ShadowSettings.from_dict(job.shadow)
        self._loss_of: Recompute | None = None  # recompute_with()
        self._checks: ShadowChecks | None = None  # made by steps() where the spec asks
        self._saves: Saves | None = None  # made by restore()
        self._clock: AttemptClock | None = None
        self._model_config: dict[str, Any] = {}
        self._flops_per_token: float | None = None
        self._stall_s = 0.0  # this step's wait for a checkpoint's staging
        # Time spent in the SDK's own per-step code since the last logged step (the sampler,
        # the step's decisions, progress, checkpoint calls): what the platform adds to a step,
        # measured inside the run, so a busy machine moves it no more than the step it divides.
        self._sdk_s = 0.0
        self._current: Step | None = None  # the step the script is in
        self._loop: Generator[Step, None, None] | None = None  # what steps() returned
        self._rules: StopRules | None = None  # made by steps()
        self._loop_start = 0  # the step steps() started from
        self._left: LeftLoop | None = None  # the script left steps() early; finish() ends it
        self._last_eval: dict[str, float | int] | None = None  # the newest report_eval
        self._serving: dict[str, str] | None = None  # serve_with(): how the model is served
        self._progress.write(event="sdk", call="init", state="returned")

    # ---- what the script reads ---------------------------------------------------------

    @property
    def resuming(self) -> bool:
        """True when this attempt continues from a committed checkpoint."""
        return self.job.resume is not None

    @property
    def init_from(self) -> Path | None:
        """Fine-tuning on a fresh start: the verified weights to begin from (a checkpoint
        folder or a safetensors file), None otherwise or when resuming."""
        if self.job.init_weights and not self.resuming:
            return Path(self.job.init_weights)
        return None

    @property
    def args(self) -> dict[str, Any]:
        """The spec's `[train.args]` table, as it was written."""
        return dict(self.settings.args)

    @property
    def vocab_size(self) -> int:
        """The dataset tokenizer's vocabulary: token ids are below it."""
        return int(self.job.model["vocab_size"])

    @property
    def model_shape(self) -> dict[str, Any]:
        """The spec's `[model]` table with the dataset's `vocab_size`."""
        return dict(self.job.model)

    def autocast(self) -> contextlib.AbstractContextManager:
        """bf16 autocast on GPUs; full precision on CPU, where bf16 matmuls are slower."""
        return self._rt.autocast()

    def dataset(self, block_size: int) -> Sampler:
        """The run's training split in windows of `block_size + 1` tokens, each data-parallel
        rank reading its slice of every global batch (`batch_size` sequences, split into
        `grad_accum_steps` micro-batches). The order is a permutation keyed by (seed, epoch),
        so a resume on any number of ranks neither skips nor repeats a sample.

        Returns the sampler `step.micro_batches()` draws from (also `run.sampler`): its
        position is the run's, kept in every checkpoint. A script that brings its own loader
        does not call this; it hands its loader's position to `restore(state=...)` (an object
        with `state_dict()`/`load_state_dict()`, the same on every rank) and gets it back on
        resume."""
        stream = TokenStream([Path(p) for p in self.job.train_shards], self.job.dtype, block_size)
        self.sampler = Sampler(
            stream,
            self.settings.seed,
            self.settings.batch_size,
            RankSlice(
                self.placement.dp_rank, self.placement.dp_size, self.settings.grad_accum_steps
            ),
        )
        return self.sampler

    def validation(self, block_size: int) -> TokenStream | None:
        """The dataset's held-out split (None for the built-in trainer without `eval_every`,
        whose node does not fetch it)."""
        if not self.job.val_shards:
            return None
        return TokenStream([Path(p) for p in self.job.val_shards], self.job.dtype, block_size)

    def eval_due(self, step: Step) -> bool:
        return bool(self.settings.eval_every) and step.number % self.settings.eval_every == 0

    def recompute_with(self, loss_of: Recompute) -> None:
        """How the platform computes one micro-batch again for the shadow checks
        (`recovery.shadow_every` in the spec): `loss_of(module, x, y)` returns the tensor the
        loop calls backward on for that micro-batch (its loss divided by the accumulation
        steps), from the model's own module (not its DDP wrapper; an FSDP model is its own).
        It must compute exactly what the loop does: the checks compare the two bit for bit on
        CPU."""
        self._loss_of = loss_of

    # ---- restore, the loop, checkpoints ------------------------------------------------

    def restore(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        model_config: dict[str, Any] | None = None,
        flops_per_token: float | None = None,
        state: Mapping[str, Any] | None = None,
    ) -> int:
        """Hand the platform the (parallelized) model and its optimizer, and load the last
        committed checkpoint into them when the run resumes (files verified by sha256 before
        any is read, resharded to this attempt's layout). Returns the step to start from.

        `model_config` goes into every checkpoint manifest (evaluation and serving rebuild the
        model from it); `flops_per_token` lets the platform report MFU. `state` names whatever
        else the script keeps, each an object with `state_dict()`/`load_state_dict()` (an LR
        scheduler, an EMA, a GradScaler, its own loader's position): in every checkpoint, and
        loaded back on resume (`forgeline.kept_state` says what its state may hold).
        """
        if self._model is not None:
            raise SDKUsageError("run.restore() was called twice")
        # Checked before anything else: a script's mistake is refused before it trains.
        self._kept = KeptState(state) if state is not None else None
        self._progress.write(event="sdk", call="restore", state="entered")
        self._model, self._optimizer = model, optimizer
        self._model_config = dict(model_config or {})
        self._flops_per_token = flops_per_token
        # Each rank's own gradients, before the reduction mixes them (norms, shadow checks).
        self._own_norms = own_gradients(
            model,
            self.placement.mesh.get_group("replicate") if self.layout.replicate > 1 else None,
            tensor_parallel=self.layout.tensor > 1,
            poison_now=ChaosPoison(self._corrupt_next, lambda: self.step + 1, self._micro_now),
            micro_now=self._micro_now,
        )
        checkpointer = checkpointer_for(
            self.job, self.store, self.layout.to_dict(), keep=self.settings.keep_checkpoints,
            asynchronous=self.settings.async_checkpoint, local_rank=self.local_rank,
        )  # fmt: skip
        load_started = time.perf_counter()
        resume, skipped = resolve(self.job, self.store, self.local_rank, checkpointer.group,
                                  self._say)  # fmt: skip
        if skipped is not None:
            self._progress.write(event="peer_skipped", why=skipped)
            self.job.resume = resume  # `resuming` tells the truth from here on
        if resume is not None:
            kept = self._kept.capture() if self._kept is not None else None
            load_training_state(model, optimizer, Path(resume.folder), kept)
            if self._kept is not None and kept is not None:
                self._kept.load(kept)
            self.step, self.tokens_seen = resume.step, resume.tokens_seen
            self.loss_history = list(resume.loss_history)
            self.samples_seen = resume.samples_seen
            if self.samples_seen is None:  # older manifests
                self.samples_seen = self.step * self.settings.batch_size
        load_s = time.perf_counter() - load_started
        # The weights change in optimizer.step(): a checkpoint being staged must have its copy
        # by then. A hook, so no script has to remember it.
        optimizer.register_step_pre_hook(self._before_weights_change)
        self._progress.write(
            event="started", step=self.step, rank=self.rank, world=self.world,
            layout=self.layout.to_dict(),
        )  # fmt: skip
        # Where the fabric is: the first thing to check when ranks of two hosts cannot meet.
        env = os.environ
        self._say(
            f"on {self.job.node_id}, {self.layout.to_dict()}, from step {self.step}; gloo over "
            f"{env.get('GLOO_SOCKET_IFNAME', '-')}, store at {env.get('MASTER_ADDR', '-')}:"
            f"{env.get('MASTER_PORT', '-')}"
        )
        self._clock = AttemptClock(
            self.store, self.job.run_id, self.job.generation, self.step,
            self._process_started_at, enabled=self.rank == 0,
        )  # fmt: skip
        self._clock.ready(load_s)
        self._saves = Saves(
            checkpointer, self._clock, self._progress, resume.step if resume else None
        )
        self._progress.write(event="sdk", call="restore", state="returned")
        return self.step

    def steps(self) -> Iterator[Step]:
        """The training loop: one `Step` per optimizer step until `steps` are done or the run
        is asked to stop. Before each step the RNG is seeded from (seed, step, rank), so a
        resumed run draws what an uninterrupted one would; after each, the ranks agree on
        stopping and checkpointing, and the platform does both. A script may leave it early
        with `break` (every rank at the same step): `run.finish()` then commits a checkpoint
        of where it stopped (`forgeline.loop_end`)."""
        if self._saves is None or self._clock is None:
            raise SDKUsageError("call run.restore(model, optimizer) before run.steps()")
        if self._loop is not None:
            raise SDKUsageError("run.steps() was called twice: a run has one training loop")
        self._loop = self._steps()
        return self._loop

    def _steps(self) -> Generator[Step, None, None]:
        assert self._saves is not None
        watch = SpikeWatch(SpikeSettings.from_dict(self.job.spikes), self.world)
        self._checks = shadow_checks(self, self._shadow, self._loss_of, self._own_norms)
        self._rules = StopRules(self.job.stragglers, self._findings, self.ranks_per_node,
                                self._term, self._stop_file, watch,
                                on_suspect=self._suspect_at)  # fmt: skip
        self._policy = CheckpointPolicy.from_train_config(self.job.train, self.job.mtbf_s)
        self._window = (time.perf_counter(), 0)
        self._sdk_s = 0.0
        self._loop_start = self.step
        self._progress.write(event="sdk", call="steps", state="entered")
        step: Step | None = None
        try:
            while self.step < self.settings.steps:
                entered = time.perf_counter()
                # Randomness (dropout) derives from (seed, step, coordinates): nothing to save
                # for resume, and a tensor-parallel group draws alike where it holds the same
                # values.
                seed_step(self.device, self.settings.seed, self.step + 1,
                          self.placement.dp_rank, self.rank, self.layout.tensor > 1)  # fmt: skip
                self._stall_s = 0.0
                step = self._current = Step(self, self.step + 1)
                if self._checks is not None:
                    self._checks.starting(step.number)
                if self._model is not None and chaos_order(
                    self._corrupt_next, step.number, "flip-bit"
                ):
                    flip_low_bit(self._model)  # `forgeline chaos flip-bit`, for tests and demos
                self._sdk_s += time.perf_counter() - entered
                yield step
                if self._after_step(step):
                    break
        except BaseException as left:
            self._leave_loop(step, crashed=not isinstance(left, GeneratorExit))
            raise
        mark_began()  # also when a resume found every step done
        self._end_loop()

    def _after_step(self, step: Step) -> bool:
        """The platform's part of a step the script has done; True when the loop must end."""
        assert self._rules is not None
        # The step's device values are read here, before the SDK's clock starts: on a GPU
        # that read waits for the device to finish the script's work, which is the step's
        # compute, not the platform's share (`sdk_share`). After it the device is idle, so
        # nothing the SDK reads below waits for the script's kernels.
        # What waits for the device each step, on a GPU, and why it must: the local gradient
        # norm in `step.gradients()` (the host decides whether to clip by it, and hands it to
        # the script as a number), and this read of the loss (every rank must decide at
        # this step, from every rank's loss, whether the gang stops on a non-finite value,
        # and the spike watch compares it every step). The step's all-gather (gloo, host
        # numbers) waits for the other ranks, not the device: all of them must agree on
        # stopping and saving at the same step. On logging steps, the mean loss too.
        step._settle()
        entered = time.perf_counter()
        stop = self._end_step(step, self._rules, first=self.step == self._loop_start)
        self._sdk_s += time.perf_counter() - entered
        mark_began()  # a failure from here on is a crash, not a script that cannot start
        return stop

    def _end_loop(self, reason: str | None = None) -> None:
        """The loop's end: its last save committed, and the run's final record where the loop
        ran its course (`reason`: why it ended before `steps`, the script's own choice)."""
        assert self._saves is not None and self._clock is not None
        self._saves.wait()
        self._saves.close()
        if self.step >= self.settings.steps:
            self._clock.end("done")
            self._progress.write(event="done", step=self.step, tokens_seen=self.tokens_seen)
        elif reason is not None:
            self._clock.end(f"done: {reason}")
            self._progress.write(event="done", step=self.step, tokens_seen=self.tokens_seen,
                                 reason=reason)  # fmt: skip

    def _leave_loop(self, step: Step | None, crashed: bool) -> None:
        """The script left the loop early, on purpose or by an exception (forgeline.loop_end):
        note where, and nothing more. Not even wait for the save in flight: this also runs
        when a crashed rank's loop is finalized at the interpreter's exit, and a save whose
        peer is gone waits there until its collective times out (collective_timeout_s: it held
        a dead node's survivors for minutes, and their gang's recovery with them). A script
        that goes on calls run.finish(), which waits (`_finish_left_loop`)."""
        self._left = LeftLoop(step, crashed)

    def _wait_for_the_save_in_flight(self) -> None:
        """Bounded: a checkpoint whose peer is gone waits out its collective's timeout."""
        assert self._saves is not None
        try:
            self._saves.wait(timeout=self.settings.collective_timeout_s)
        except Exception as failed:  # the exception unwinding (if any) is the one to report
            self._say(f"the checkpoint in flight when the loop was left failed: {failed!r}")

    def _finish_left_loop(self, left: LeftLoop) -> None:
        """`run.finish()` after the script left the loop: a `break` finishes the step it was in
        and commits where it stopped; a crash saves nothing more (forgeline.loop_end)."""
        assert self._saves is not None and self._clock is not None
        if not left.on_purpose():
            self._wait_for_the_save_in_flight()  # what it commits is not redone
            unwinding = sys.exc_info()[1]
            why = f"{type(unwinding).__name__}: {unwinding}" if unwinding else "the step failed"
            at = left.step.number if left.step is not None else self.step
            self._clock.end(f"failed: the loop was left at step {at} ({why})"[:500])
            return
        mark_began()  # a loop that ended, however early, trained
        if left.step is not None and left.step_finished and self._after_step(left.step):
            self._saves.close()  # it stopped (asked to, or fenced) and said so
            return
        if self.step > 0 and not self._saves.holds(self.step):
            self.checkpoint()
        self._end_loop(reason=f"the script's loop ended at step {self.step} of "
                              f"{self.settings.steps}")  # fmt: skip

    @contextlib.contextmanager
    def evaluating(self) -> Iterator[None]:
        """Wrap an evaluation inside the loop: its time is booked as evaluation in the goodput
        ledger, not as training throughput."""
        started = time.perf_counter()
        try:
            yield
        finally:
            spent = time.perf_counter() - started
            if self._clock is not None:
                self._clock.add(eval_s=spent)
            # Neither the step's time (straggler watch, ledger) nor tokens/s count it.
            self._window = (self._window[0] + spent, self._window[1])
            if self._current is not None:
                self._current.started += spent

    def report_eval(self, step: Step, val_loss: float, val_tokens: int) -> None:
        """A held-out loss measured at this step (every rank passes the same, already
        reduced). The newest one goes into every later checkpoint's manifest: for a script of
        the user's, it is the evaluation the run registers and the eval gate judges."""
        self._last_eval = {"step": step.number, "val_loss": float(val_loss),
                           "val_tokens": int(val_tokens)}  # fmt: skip
        self._progress.write(event="eval", **self._last_eval)

    def serve_with(self, module: str) -> None:
        """Name the module of your code folder that serves the trained model: it defines
        `load(weights, config, tokenizer) -> model` (weights: the state dict, as safetensors
        holds it; config: the `model_config` given to restore(); tokenizer: the dataset's
        `tokenizers.Tokenizer`) and `predict(model, prompts, params) -> list[str]`. The
        registered version then carries your code and serves with `forgeline serve`; without
        this call it holds the weights and lineage only. The module must import neither
        forgeline nor anything your requirements.txt does not declare: it runs where only
        those are installed."""
        if not SERVING_MODULE.fullmatch(module):
            raise SDKUsageError(f"run.serve_with({module!r}): give a module name such as 'serve'")
        folder = Path(self.job.code_dir) if self.job.code_dir else None
        path = Path(*module.split("."))
        if folder is not None and not (
            (folder / path).with_suffix(".py").is_file()
            or (folder / path / "__init__.py").is_file()
        ):
            raise SDKUsageError(
                f"run.serve_with({module!r}): there is no {path}.py in your code folder"
            )
        self._serving = {"module": module}

    def finish(self) -> None:
        """Leave the process group; the last call of a rank script. After a loop the script
        left with `break`, it first ends the loop: the step the script was in, a checkpoint of
        where it stopped, the run's final record (every rank calls it: a collective)."""
        if self._loop is not None:
            # A loop the script still holds (`it = run.steps()`) ends here, as after a break.
            self._loop.close()
        left, self._left = self._left, None
        if left is not None:
            self._finish_left_loop(left)
        if dist.is_initialized():
            dist.destroy_process_group()

    # ---- the platform's side of a step -------------------------------------------------

    def _before_weights_change(self, *_: object) -> None:
        if self._current is not None:
            self._current.weights_changed = True
        if self._saves is not None:
            started = time.perf_counter()
            self._saves.checkpointer.before_weights_change()
            self._stall_s += time.perf_counter() - started

    def _micro_now(self) -> int:
        """The micro-batch of the step being computed, from 1 (0: none handed out yet)."""
        return self._current.micro_index if self._current else 0

    def _suspect_at(self, step: int) -> None:
        """A rank was named a suspect at `step`: keep what a rollback past it needs (rank 0
        pins), and check the next step's work at once where the run has shadow checks."""
        points = self._saves.checkpointer.rollback_points if self._saves else None
        if points is not None:
            points.suspect_at(step)
        if self._checks is not None:
            self._checks.check_next(step)

    def _end_step(self, step: Step, rules: StopRules, first: bool) -> bool:
        """Everything after the script's optimizer step; True when the loop must end."""
        assert self._saves is not None and self._clock is not None
        if self._checks is not None:
            self._checks.step_ended()
        saves = self._saves
        cfg = self.settings
        own_loss = step.own_loss  # read by step._settle(), once
        if step.loss is not None and not math.isfinite(own_loss):
            step.finite = False
        self.step = step.number
        self.samples_seen += cfg.batch_size
        tokens_per_step = cfg.batch_size * (self.sampler.stream.block_size if self.sampler else 0)
        self.tokens_seen += tokens_per_step
        self._window = (self._window[0], self._window[1] + 1)
        saves.poll()

        asked = rules.request(step, fenced=saves.fenced)
        # Time and epoch boundaries are rank 0's call, so every rank saves at the same step.
        save_due = self.rank == 0 and self._policy.due(
            self.step,
            time.monotonic() - saves.last_save_at,
            epoch_ended=self._epoch_ended(),
            stall_s=saves.costs[0],
            commit_s=saves.costs[1],
        )
        # A peer-tier save only when no save is on its way: it must never make the loop wait.
        peer_due = (
            self.rank == 0
            and saves.checkpointer.peer is not None
            and cfg.peer_every > 0
            and self.step % cfg.peer_every == 0
            and not saves.checkpointer.busy
        )
        step_s = time.perf_counter() - step.started
        grad_norm = step.grad_norm if step.grad_norm is not None else 0.0
        call = STORE_SAVE if save_due else PEER_SAVE if peer_due else NO_SAVE
        shared = share_step(asked, call, step_s, grad_norm, step.forward_s, own_loss)
        stop, straggler_s = rules.judge(self.step, shared, step_s - self._stall_s, shared.stop)
        self._clock.step_done(
            self.step,
            train_s=step_s - self._stall_s,
            stall_s=self._stall_s,
            straggler_s=straggler_s,
            shadow_s=step.shadow_s,
        )
        if stop == NON_FINITE:
            self._fail_non_finite(shared)
        if step.verdict is not None:
            self._act_on(step.verdict)

        # The first step of a (re)start is always reported: it marks when recovery paid off.
        on_grid = self.step % cfg.log_every == 0 or self.step == cfg.steps
        if on_grid or first:
            self._log_step(step, shared, tokens_per_step, on_grid)

        if stop == FENCED:
            # A save that straddled the fence may still report; it goes before the stop, so
            # "stopped" is the last word of this generation.
            self._stop_here("fenced")
            return True
        if stop or shared.save or self.step == cfg.steps:
            self.checkpoint()
        elif shared.peer:
            self._save(peer=True)
        if stop:
            # After the commit landed: only then is it safe.
            self._stop_here(rules.reason(stop, fenced=saves.fenced))
            return True
        return False

    def _say(self, text: str) -> None:
        """A line of this rank's log (`forgeline logs RUN --rank R`), every rank's own."""
        print(f"[rank {self.rank}/{self.world} gen {self.job.generation}] {text}", flush=True)

    def _stop_here(self, reason: str) -> None:
        assert self._saves is not None and self._clock is not None
        self._saves.wait()
        self._clock.end(f"stopped: {reason}")
        self._progress.write(event="stopped", step=self.step, tokens_seen=self.tokens_seen,
                             reason=reason)  # fmt: skip

    def _epoch_ended(self) -> bool:
        if self.sampler is None:
            return False
        return self.sampler.epoch(self.samples_seen) > self.sampler.epoch(
            self.samples_seen - self.settings.batch_size
        )

    def _log_step(self, step: Step, shared: StepShare, tokens_per_step: int, on_grid: bool) -> None:
        loss = step.loss if step.loss is not None else torch.zeros(())
        # Each tensor-parallel rank holds the same loss; averaging over all ranks is exact.
        mean_loss = loss.detach().to(self.device, torch.float32).clone()
        if self.world > 1:  # the mean over one rank is its own loss
            dist.all_reduce(mean_loss, op=dist.ReduceOp.AVG)
        mean = mean_loss.item()  # read once: only a logged value
        started, steps = self._window
        elapsed = time.perf_counter() - started
        tokens_per_s = steps * tokens_per_step / elapsed
        cfg = self.settings
        if on_grid:  # the same points whether or not the run was ever restarted
            self.loss_history.append([self.step, mean])
            self._say(f"step {self.step}/{cfg.steps} loss {mean:.4f} tokens/s {tokens_per_s:,.0f}")
        self._progress.write(
            event="step",
            step=self.step,
            total_steps=cfg.steps,
            loss=mean,
            lr=step.metrics.get("lr"),
            tokens_per_s=tokens_per_s,
            mfu=(
                mfu(tokens_per_s, self._flops_per_token, cfg.peak_flops_per_gpu, self.world)
                if self._flops_per_token and cfg.peak_flops_per_gpu
                else None
            ),
            checkpoint_step=self._saves.last_committed if self._saves else None,
            epoch=self.sampler.epoch(self.samples_seen) if self.sampler else 0,
            rank_step_s=shared.step_s,
            rank_grad_norm=shared.grad_norm,
            sdk_share=self._sdk_s / elapsed,
            metrics={k: v for k, v in step.metrics.items() if k != "lr"},
        )
        self._window = (time.perf_counter(), 0)
        self._sdk_s = 0.0  # the rest of this step's platform work falls in the next window

    def checkpoint(self) -> None:
        """Start an asynchronous checkpoint of the model, the optimizer and the state named in
        `restore(state=...)` at this step (every rank calls it; the loop does so by the spec's
        policy, and on every stop). It returns once the state is being copied; the files
        upload and the manifest commits in the background."""
        self._save(peer=False)

    def _save(self, peer: bool) -> None:
        assert self._saves is not None
        assert self._model is not None and self._optimizer is not None
        sampler = self.sampler
        self._saves.save(
            self._model,
            self._optimizer,
            self.step,
            peer=peer,
            extra=self._kept.capture() if self._kept is not None else None,
            meta={
                "tokens_seen": self.tokens_seen,
                "samples_seen": self.samples_seen,
                "epoch": sampler.epoch(self.samples_seen) if sampler else 0,
                "data_cursor": {
                    "kind": "epoch-permutation",
                    "seed": self.settings.seed,
                    "samples_seen": self.samples_seen,
                    "samples_per_epoch": sampler.stream.samples if sampler else 0,
                },
                "rng": "derived from (seed, step, rank) at every step",
                "model_config": self._model_config,
                "train_config": self.job.train,
                "loss_history": self.loss_history,
                "evaluation": self._last_eval,
                "serving": self._serving,
                **self.job.lineage,
            },
        )

    def _fail_non_finite(self, shared: StepShare) -> None:
        """End this attempt so the run resumes from the last committed checkpoint, which holds
        none of the NaN or inf the gang saw."""
        reason = self._findings.non_finite(self.step, shared.grad_norm)
        self._fail("non-finite loss or gradients", reason)

    def _act_on(self, verdict: Verdict) -> None:
        """A shadow check disagreed. Ranks named: the attempt fails, their nodes are
        quarantined and the run rolls back past the last passed check (rank 0 keeps the
        checkpoints from before it). None named: reported, and the gang goes on."""
        assert self._checks is not None
        since = self._checks.unverified_since
        if not verdict.ranks:
            self._findings.health("shadow-mismatch", verdict.step, None, "report", verdict.evidence)
            return
        assert self._saves is not None
        if (points := self._saves.checkpointer.rollback_points) is not None:  # rank 0's
            points.suspect_at(since)
        reason = self._findings.shadow_verdict(verdict, since)
        self._fail("a shadow recompute disagreed", reason)

    def _fail(self, what: str, reason: str) -> None:
        """End this attempt with the exit status of corruption: nothing from this step on is
        saved, and the run resumes from a checkpoint committed before it."""
        assert self._saves is not None and self._clock is not None
        self._clock.end(f"failed: {what}")
        self._progress.write(event="failed", step=self.step, reason=reason)
        self._saves.close()  # a save in flight was staged before this step: let it commit
        dist.destroy_process_group()
        sys.exit(EXIT_NON_FINITE)


def init(job_path: str | None = None) -> Run:
    """Join the gang and return this rank's `Run`: the first call of a rank script.

    The node agent starts torchrun with the job file's path in `FORGELINE_JOB` (and as the
    script's first argument, for the built-in trainer); `job_path` overrides both.
    """
    process_started_at = time.time()
    path = job_path or os.environ.get("FORGELINE_JOB") or (sys.argv[1] if len(sys.argv) > 1 else "")
    if not path:
        raise SDKUsageError(
            "forgeline.init() found no job file: a rank script runs under a Forgeline node "
            "agent, which sets FORGELINE_JOB (submit it with `forgeline run SPEC`)"
        )
    return Run(TrainJob.read(Path(path)), process_started_at)
