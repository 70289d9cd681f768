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

This module holds the calls the script makes; the platform's side of each step, and the loop's
end, are `forgeline.step_loop`'s, and what a health verdict does, `forgeline.health_verdicts`'.

The script keeps what is its own: the model, the optimizer, the forward and backward pass,
and whatever else it names in `restore(state=...)` (`forgeline.kept_state`): checkpointed and
restored with them.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from forgeline.errors import SDKUsageError
from forgeline.findings import Findings
from forgeline.kept_state import KeptState
from forgeline.saves import Saves
from forgeline.shadow import ShadowChecks
from forgeline.step import Step
from forgeline.step_loop import StepLoop
from infra.store.factory import open_store
from trainer import runtime
from trainer.activation_recompute import recompute
from trainer.attempt_clock import AttemptClock
from trainer.checkpoint import load_training_state
from trainer.data import RankSlice, Sampler, TokenStream
from trainer.grad_watch import ChaosPoison, OwnGradients
from trainer.job import TrainJob
from trainer.job_checkpoints import checkpointer_for, resolve
from trainer.own_gradients import own_gradients
from trainer.parallel import Layout, Placement, build_mesh
from trainer.pipeline import Pipeline, PipelineSettings
from trainer.progress import ProgressFile
from trainer.shadow_check import Recompute, ShadowSettings
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
        self.layout = Layout.from_job(job.layout) if job.layout else Layout(replicate=rt.world)
        # The spec's pipeline (ranks, schedule, stages a rank, micro-batches): 1 rank, none.
        self.pipeline_settings = PipelineSettings.from_layout(job.layout)
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
        # Set when the loop starts (forgeline.step_loop): (its start, steps since) for the
        # logged tokens/s, which evaluating() moves on by the evaluation's time.
        self._window: tuple[float, int]
        self._loop: StepLoop | None = None  # made by steps()
        self._last_eval: dict[str, float | int] | None = None  # the newest report_eval
        self._serving: dict[str, str] | None = None  # serve_with(): how the model is served
        self._recomputed: int | None = None  # recompute_activations(): blocks recomputed
        self._pipeline: Pipeline | None = None  # pipeline(): this rank's stages and schedule
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

    @property
    def activation_checkpointing(self) -> str:
        """The spec's `parallel.activation_checkpointing`: "none", "full" or "selective"."""
        return str(self.job.layout.get("activation_checkpointing", "none"))

    def recompute_activations(self, blocks: Iterable[torch.nn.Module]) -> int:
        """Recompute the activations of `blocks` in backward as the spec's
        `parallel.activation_checkpointing` says (`trainer.activation_recompute`); "none" keeps
        them. Pass the model's repeated layers (the built-in GPT's `model.blocks`), each called
        with its inputs as arguments, before `run.restore()`; their parameter names, and so the
        checkpoints, do not change. A spec that asks for recomputation from a script that never
        calls this is refused at `run.steps()`. Returns how many blocks recompute."""
        if self._model is not None:
            raise SDKUsageError("call run.recompute_activations() before run.restore()")
        if self._recomputed is not None:
            raise SDKUsageError("run.recompute_activations() was called twice: pass every block")
        self._recomputed = recompute(blocks, self.activation_checkpointing)
        return self._recomputed

    @property
    def stages(self) -> list[int]:
        """The pipeline stages this rank holds (`[0]` without a pipeline): build one module
        for each, with `run.stage_layers(n)` saying which of your model's n layers it runs,
        and hand them to `run.pipeline()`."""
        settings = self.pipeline_settings
        return settings.stages_of(self.placement.mesh.get_local_rank("pipeline"))

    def stage_layers(self, layers: int) -> list[range]:
        """For each of `run.stages`, which of a model's `layers` repeated layers it runs (the
        layers split evenly, in order); refused with the reason where they do not split."""
        settings = self.pipeline_settings
        return [settings.layers_of(stage, layers) for stage in self.stages]

    def pipeline(
        self,
        stages: Sequence[torch.nn.Module],
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        tied: Sequence[torch.nn.Parameter] | None = None,
    ) -> Pipeline:
        """This rank's stages (one module for each of `run.stages`, in that order; the first
        stage takes the inputs, the last returns what `loss_fn(output, targets)` takes) and
        the spec's schedule to run them: `pipeline.step(x, y)` in the loop is the step's
        forward and backward over `parallel.microbatches` micro-batches, and returns its mean
        loss on every rank. `tied`: the weights both the first and the last stage hold (a
        tied embedding; None if the model ties none), whose gradients are summed across the
        two. Call it before `run.restore()`, which takes a module holding all of this rank's
        stages' parameters under the names they have in the whole model."""
        if self._model is not None:
            raise SDKUsageError("call run.pipeline() before run.restore()")
        if self._pipeline is not None:
            raise SDKUsageError("run.pipeline() was called twice: a rank has one pipeline")
        self._pipeline = Pipeline(
            list(stages), self.pipeline_settings, self.placement.mesh, self.device, loss_fn, tied
        )
        return self._pipeline

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
            layout=self.layout.to_dict(), activation_checkpointing=self.activation_checkpointing,
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
        if self.pipeline_settings.on and self._pipeline is None:
            raise SDKUsageError(
                f"the spec splits the model into a pipeline of {self.pipeline_settings.stages} "
                "stages (parallel.pipeline), but the script declared none: build a module for "
                "each of run.stages and hand them to run.pipeline(), or set pipeline = 1"
            )
        if self.activation_checkpointing != "none" and not self._recomputed:
            raise SDKUsageError(
                f"the spec asks for parallel.activation_checkpointing = "
                f'"{self.activation_checkpointing}", but the script named no blocks to '
                "recompute: call run.recompute_activations(model.blocks) (your model's repeated "
                'layers) before run.restore(), or set activation_checkpointing = "none"'
            )
        self._loop = StepLoop(self, self._saves, self._clock, self._progress, self._findings)
        return self._loop.steps

    @contextlib.contextmanager
    def evaluating(self) -> Iterator[None]:
        """Wrap an evaluation inside the loop: its time is booked as evaluation in the goodput
        ledger, not as training throughput."""
        started = time.perf_counter()
        untimed = self._pipeline.untimed() if self._pipeline else contextlib.nullcontext()
        try:
            with untimed:  # its forwards are not the step's
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
            self._loop.finish()
        if dist.is_initialized():
            dist.destroy_process_group()

    # ---- the platform's side of a step: hooks and saves (the rest: forgeline.step_loop) --

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

    def _say(self, text: str) -> None:
        """A line of this rank's log (`forgeline logs RUN --rank R`), every rank's own."""
        print(f"[rank {self.rank}/{self.world} gen {self.job.generation}] {text}", flush=True)

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
