"""One `run.steps()` loop: the platform's side of every step, and the loop's end.

`Run.steps()` hands the script this loop's generator. Between two of its steps everything the
platform does happens here: the step's device values read once, the run's position advanced,
the gang's one all-gather (stop requests, the save to make, times, norms and losses), the
straggler, spike and corruption verdicts acted on (`forgeline.health_verdicts`), the logged
step, and the checkpoint that the interval policy or a stop asks for. Its end is the loop's
end: the last save committed and the run's final record; or, where the script left early,
what `run.finish()` makes of it (`forgeline.loop_end`).

It takes the `Run` itself, not only its collaborators: the run's position (`step`,
`tokens_seen`, `samples_seen`, `loss_history`) is what the script reads, so it stays on the
`Run` and the loop advances it there, and each `Step` it hands out is a step of that run.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Generator
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from forgeline.findings import Findings
from forgeline.health_verdicts import HealthVerdicts
from forgeline.loop_end import LeftLoop
from forgeline.saves import Saves
from forgeline.shadow import shadow_checks
from forgeline.step import Step
from forgeline.stops import StopRules
from trainer.attempt_clock import AttemptClock
from trainer.checkpoint_policy import CheckpointPolicy
from trainer.entry import mark_began
from trainer.grad_watch import chaos_order, flip_low_bit
from trainer.metrics import mfu
from trainer.progress import ProgressFile
from trainer.rng_streams import seed_step
from trainer.spike_watch import SpikeSettings, SpikeWatch
from trainer.step_share import NO_SAVE, PEER_SAVE, STORE_SAVE, StepShare, share_step
from trainer.stop_reasons import FENCED, NON_FINITE

if TYPE_CHECKING:
    from forgeline.training import Run


class StepLoop:
    """The training loop of one `run.steps()` call, made by it after `restore()` (which made
    the saves and the attempt's clock). `steps` is what the script iterates; nothing of the
    loop is set up until the script asks for its first step, as a generator's body runs."""

    def __init__(
        self,
        run: Run,
        saves: Saves,
        clock: AttemptClock,
        progress: ProgressFile,
        findings: Findings,
    ) -> None:
        self.run = run
        self.saves = saves
        self.clock = clock
        self.progress = progress
        self.findings = findings
        self.left: LeftLoop | None = None  # the script left the loop early; finish() ends it
        # Made when the first step is asked for:
        self._rules: StopRules | None = None
        self._policy: CheckpointPolicy | None = None
        self._health: HealthVerdicts | None = None
        self._start = 0  # the step the loop started from
        self.steps: Generator[Step, None, None] = self._steps()

    def finish(self) -> None:
        """`run.finish()`'s part of the loop: a loop the script still holds
        (`it = run.steps()`) ends here, as after a break, and one the script left early is
        finished (`_finish_left`)."""
        self.steps.close()
        left, self.left = self.left, None
        if left is not None:
            self._finish_left(left)

    def _steps(self) -> Generator[Step, None, None]:
        run = self.run
        watch = SpikeWatch(SpikeSettings.from_dict(run.job.spikes), run.world)
        checks = run._checks = shadow_checks(run, run._shadow, run._loss_of, run._own_norms)
        self._health = HealthVerdicts(self.findings, self.progress, self.saves, self.clock, checks)
        # Under a pipeline a rank is compared with the ranks of its own stage.
        peers = run._pipeline.stage_of_each_rank if run._pipeline else None
        self._rules = StopRules(run.job.stragglers, self.findings, run.ranks_per_node,
                                run._term, run._stop_file, watch,
                                on_suspect=self._health.suspect_at, peers=peers)  # fmt: skip
        self._policy = CheckpointPolicy.from_train_config(run.job.train, run.job.mtbf_s)
        run._window = (time.perf_counter(), 0)
        run._sdk_s = 0.0
        self._start = run.step
        self.progress.write(event="sdk", call="steps", state="entered")
        step: Step | None = None
        try:
            while run.step < run.settings.steps:
                entered = time.perf_counter()
                # Randomness (dropout) derives from (seed, step, coordinates): nothing to save
                # for resume, and a tensor-parallel group draws alike where it holds the same
                # values.
                seed_step(run.device, run.settings.seed, run.step + 1,
                          run.placement.dp_rank, run.rank, run.layout.tensor > 1)  # fmt: skip
                run._stall_s = 0.0
                step = run._current = Step(run, run.step + 1)
                if checks is not None:
                    checks.starting(step.number)
                if run._model is not None and chaos_order(
                    run._corrupt_next, step.number, "flip-bit"
                ):
                    flip_low_bit(run._model)  # `forgeline chaos flip-bit`, for tests and demos
                run._sdk_s += time.perf_counter() - entered
                yield step
                if self._after_step(step):
                    break
        except BaseException as left:
            self._leave(step, crashed=not isinstance(left, GeneratorExit))
            raise
        mark_began()  # also when a resume found every step done
        self._end()

    def _after_step(self, step: Step) -> bool:
        """The platform's part of a step the script has done; True when the loop must end."""
        run = self.run
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
        stop = self._end_step(step, first=run.step == self._start)
        run._sdk_s += time.perf_counter() - entered
        mark_began()  # a failure from here on is a crash, not a script that cannot start
        return stop

    def _end_step(self, step: Step, first: bool) -> bool:
        """Everything after the script's optimizer step; True when the loop must end."""
        rules, policy, health = self._rules, self._policy, self._health
        assert rules is not None and policy is not None and health is not None
        run = self.run
        if run._checks is not None:
            run._checks.step_ended()
        saves = self.saves
        cfg = run.settings
        own_loss = step.own_loss  # read by step._settle(), once
        if step.loss is not None and not math.isfinite(own_loss):
            step.finite = False
        run.step = step.number
        run.samples_seen += cfg.batch_size
        tokens_per_step = cfg.batch_size * (run.sampler.stream.block_size if run.sampler else 0)
        run.tokens_seen += tokens_per_step
        run._window = (run._window[0], run._window[1] + 1)
        saves.poll()

        asked = rules.request(step, fenced=saves.fenced)
        # Time and epoch boundaries are rank 0's call, so every rank saves at the same step.
        save_due = run.rank == 0 and policy.due(
            run.step,
            time.monotonic() - saves.last_save_at,
            epoch_ended=self._epoch_ended(),
            stall_s=saves.costs[0],
            commit_s=saves.costs[1],
        )
        # A peer-tier save only when no save is on its way: it must never make the loop wait.
        peer_due = (
            run.rank == 0
            and saves.checkpointer.peer is not None
            and cfg.peer_every > 0
            and run.step % cfg.peer_every == 0
            and not saves.checkpointer.busy
        )
        step_s = time.perf_counter() - step.started
        grad_norm = step.grad_norm if step.grad_norm is not None else 0.0
        call = STORE_SAVE if save_due else PEER_SAVE if peer_due else NO_SAVE
        shared = share_step(asked, call, step_s, grad_norm, step.forward_s, own_loss)
        stop, straggler_s = rules.judge(run.step, shared, step_s - run._stall_s, shared.stop)
        # A pipeline's ranks idle for its bubble: booked at the schedule's share of the step
        # that was neither waiting for a straggler nor checking.
        working = step_s - run._stall_s - straggler_s - step.shadow_s
        self.clock.step_done(
            run.step,
            train_s=step_s - run._stall_s,
            stall_s=run._stall_s,
            straggler_s=straggler_s,
            shadow_s=step.shadow_s,
            bubble_s=max(working, 0.0) * run.pipeline_settings.bubble(),
        )
        if stop == NON_FINITE:
            health.fail_non_finite(run.step, shared)
        if step.verdict is not None:
            health.act_on(step.verdict, run.step)

        # The first step of a (re)start is always reported: it marks when recovery paid off.
        on_grid = run.step % cfg.log_every == 0 or run.step == cfg.steps
        if on_grid or first:
            self._log_step(step, shared, tokens_per_step, on_grid)

        if stop == FENCED:
            # A save that straddled the fence may still report; it goes before the stop, so
            # "stopped" is the last word of this generation.
            self._stop_here("fenced")
            return True
        if stop or shared.save or run.step == cfg.steps:
            run.checkpoint()
        elif shared.peer:
            run._save(peer=True)
        if stop:
            # After the commit landed: only then is it safe.
            self._stop_here(rules.reason(stop, fenced=saves.fenced))
            return True
        return False

    def _stop_here(self, reason: str) -> None:
        self.saves.wait()
        self.clock.end(f"stopped: {reason}")
        self.progress.write(event="stopped", step=self.run.step,
                            tokens_seen=self.run.tokens_seen, reason=reason)  # fmt: skip

    def _epoch_ended(self) -> bool:
        run = self.run
        if run.sampler is None:
            return False
        return run.sampler.epoch(run.samples_seen) > run.sampler.epoch(
            run.samples_seen - run.settings.batch_size
        )

    def _log_step(self, step: Step, shared: StepShare, tokens_per_step: int, on_grid: bool) -> None:
        run = self.run
        loss = step.loss if step.loss is not None else torch.zeros(())
        # Each tensor-parallel rank holds the same loss; averaging over all ranks is exact.
        mean_loss = loss.detach().to(run.device, torch.float32).clone()
        if run.world > 1:  # the mean over one rank is its own loss
            dist.all_reduce(mean_loss, op=dist.ReduceOp.AVG)
        mean = mean_loss.item()  # read once: only a logged value
        started, steps = run._window
        elapsed = time.perf_counter() - started
        tokens_per_s = steps * tokens_per_step / elapsed
        cfg = run.settings
        if on_grid:  # the same points whether or not the run was ever restarted
            run.loss_history.append([run.step, mean])
            run._say(f"step {run.step}/{cfg.steps} loss {mean:.4f} tokens/s {tokens_per_s:,.0f}")
        self.progress.write(
            event="step",
            step=run.step,
            total_steps=cfg.steps,
            loss=mean,
            lr=step.metrics.get("lr"),
            tokens_per_s=tokens_per_s,
            mfu=(
                mfu(tokens_per_s, run._flops_per_token, cfg.peak_flops_per_gpu, run.world)
                if run._flops_per_token and cfg.peak_flops_per_gpu
                else None
            ),
            checkpoint_step=self.saves.last_committed,
            epoch=run.sampler.epoch(run.samples_seen) if run.sampler else 0,
            rank_step_s=shared.step_s,
            rank_grad_norm=shared.grad_norm,
            sdk_share=run._sdk_s / elapsed,
            metrics={k: v for k, v in step.metrics.items() if k != "lr"},
        )
        run._window = (time.perf_counter(), 0)
        run._sdk_s = 0.0  # the rest of this step's platform work falls in the next window

    def _end(self, reason: str | None = None) -> None:
        """The loop's end: its last save committed, and the run's final record where the loop
        ran its course (`reason`: why it ended before `steps`, the script's own choice)."""
        run = self.run
        self.saves.wait()
        self.saves.close()
        if run.step >= run.settings.steps:
            self.clock.end("done")
            self.progress.write(event="done", step=run.step, tokens_seen=run.tokens_seen)
        elif reason is not None:
            self.clock.end(f"done: {reason}")
            self.progress.write(event="done", step=run.step, tokens_seen=run.tokens_seen,
                                reason=reason)  # fmt: skip

    def _leave(self, step: Step | None, crashed: bool) -> None:
        """The script left the loop early, on purpose or by an exception (forgeline.loop_end):
        note where, and nothing more. Not even wait for the save in flight: this also runs
        when a crashed rank's loop is finalized at the interpreter's exit, and a save whose
        peer is gone waits there until its collective times out (collective_timeout_s: it held
        a dead node's survivors for minutes, and their gang's recovery with them). A script
        that goes on calls run.finish(), which waits (`_finish_left`)."""
        self.left = LeftLoop(step, crashed)

    def _wait_for_the_save_in_flight(self) -> None:
        """Bounded: a checkpoint whose peer is gone waits out its collective's timeout."""
        try:
            self.saves.wait(timeout=self.run.settings.collective_timeout_s)
        except Exception as failed:  # the exception unwinding (if any) is the one to report
            self.run._say(f"the checkpoint in flight when the loop was left failed: {failed!r}")

    def _finish_left(self, left: LeftLoop) -> None:
        """`run.finish()` after the script left the loop: a `break` finishes the step it was in
        and commits where it stopped; a crash saves nothing more (forgeline.loop_end)."""
        run = self.run
        if not left.on_purpose():
            self._wait_for_the_save_in_flight()  # what it commits is not redone
            unwinding = sys.exc_info()[1]
            why = f"{type(unwinding).__name__}: {unwinding}" if unwinding else "the step failed"
            at = left.step.number if left.step is not None else run.step
            self.clock.end(f"failed: the loop was left at step {at} ({why})"[:500])
            return
        mark_began()  # a loop that ended, however early, trained
        if left.step is not None and left.step_finished and self._after_step(left.step):
            self.saves.close()  # it stopped (asked to, or fenced) and said so
            return
        if run.step > 0 and not self.saves.holds(run.step):
            run.checkpoint()
        self._end(reason=f"the script's loop ended at step {run.step} of "
                         f"{run.settings.steps}")  # fmt: skip
