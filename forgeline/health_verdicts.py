"""What a rank does with the gang's health verdicts: a rank named a suspect, a non-finite loss
or gradient, a shadow recompute that disagreed. Every rank reads the same all-gathered numbers,
so every rank reaches the same verdict and acts on it here at the same step.

Kept apart from the loop that asks for them (`forgeline.step_loop`): what ends an attempt as a
corrupt one, and what it leaves for the rollback, reads in one place.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import NoReturn

import torch.distributed as dist

from forgeline.findings import Findings
from forgeline.saves import Saves
from forgeline.shadow import ShadowChecks
from trainer.attempt_clock import AttemptClock
from trainer.progress import ProgressFile
from trainer.shadow_check import Verdict
from trainer.step_share import EXIT_NON_FINITE, StepShare


@dataclass
class HealthVerdicts:
    """One `run.steps()` loop's answers to its health checks. Made when the loop starts, once
    its shadow checks are known."""

    findings: Findings  # written for the node agent, which passes them to the run
    progress: ProgressFile
    saves: Saves  # rank 0's rollback points; the save in flight a failure lets commit
    clock: AttemptClock
    checks: ShadowChecks | None  # None where the spec asks for no shadow checks

    def suspect_at(self, step: int) -> None:
        """A rank was named a suspect at `step`: keep what a rollback past it needs (rank 0
        pins), and check the next step's work at once where the run has shadow checks."""
        points = self.saves.checkpointer.rollback_points
        if points is not None:
            points.suspect_at(step)
        if self.checks is not None:
            self.checks.check_next(step)

    def fail_non_finite(self, step: int, shared: StepShare) -> NoReturn:
        """End this attempt so the run resumes from the last committed checkpoint, which holds
        none of the NaN or inf the gang saw."""
        reason = self.findings.non_finite(step, shared.grad_norm)
        self.fail(step, "non-finite loss or gradients", reason)

    def act_on(self, verdict: Verdict, step: int) -> None:
        """A shadow check disagreed. Ranks named: the attempt fails, their nodes are
        quarantined and the run rolls back past the last passed check (rank 0 keeps the
        checkpoints from before it). None named (two ranks, or a third that agrees with
        neither): the step is known wrong, not whose it is, so the attempt fails all the same
        and the run resumes from its last committed checkpoint, no node blamed. Trained on, the
        wrong step would be averaged into every replica for good."""
        assert self.checks is not None  # only a check reaches a verdict
        since = self.checks.unverified_since
        if not verdict.ranks:
            reason = self.findings.shadow_unattributed(verdict)
            self.fail(step, "a shadow recompute disagreed", reason)
        if (points := self.saves.checkpointer.rollback_points) is not None:  # rank 0's
            points.suspect_at(since)
        reason = self.findings.shadow_verdict(verdict, since)
        self.fail(step, "a shadow recompute disagreed", reason)

    def fail(self, step: int, what: str, reason: str) -> NoReturn:
        """End this attempt at `step` with the exit status of corruption: nothing from this
        step on is saved, and the run resumes from a checkpoint committed before it."""
        self.clock.end(f"failed: {what}")
        self.progress.write(event="failed", step=step, reason=reason)
        self.saves.close()  # a save in flight was staged before this step: let it commit
        dist.destroy_process_group()
        sys.exit(EXIT_NON_FINITE)
