"""A rank's part in the shadow checks (trainer.shadow_check): record its own gradients, compute
its target's micro-batch again, and reach the gang's verdict from one all-gather (two where a
third rank must break a tie). Every rank reads the same tables, so every rank reaches the same
verdict and acts on it at the same step."""

from __future__ import annotations

import math
import sys
from typing import TYPE_CHECKING

import torch
from torch.nn.parallel import DistributedDataParallel

from forgeline.errors import SDKUsageError
from trainer.grad_watch import OwnGradients
from trainer.rng_streams import forked, seed_step
from trainer.shadow_check import (
    FINGERPRINT_SIZE,
    Fingerprint,
    Recompute,
    Ring,
    ShadowSettings,
    Verdict,
    disagreements,
    settle,
    ties_needed,
)
from trainer.step_share import gather_rows

if TYPE_CHECKING:
    from forgeline.step import Step
    from forgeline.training import Run


class ShadowChecks:
    def __init__(
        self, run: Run, settings: ShadowSettings, loss_of: Recompute, own: OwnGradients
    ) -> None:
        self.run = run
        self.settings = settings
        self.loss_of = loss_of
        self.own = own
        self.ring = Ring(run.world, run.ranks_per_node, run.layout.tensor)
        # The first step whose result no check has verified yet: the step after the one the
        # attempt resumed from, then each passed check's own step (its update is not verified).
        self.unverified_since = run.step + 1
        self._recording = False  # this step's own gradients are being kept
        self._loop_checked = False  # the loop's shape was found comparable
        self._asked: int | None = None  # a step checked out of turn (after a suspect)

    def check_next(self, suspect_step: int) -> None:
        """The suspect watch named a rank at `suspect_step` (every rank reads the same table,
        so every rank asks): check the very next step rather than wait for the turn. A device
        that keeps computing wrong is named there; a one-off leaves the suspect standing."""
        self._asked = suspect_step + 1

    def _due(self, step: int) -> bool:
        return self.settings.due(step) or step == self._asked

    def starting(self, step: int) -> None:
        """Before the step's backward: keep its own gradients where the step is checked, and
        on the attempt's first step (to refuse a loop the checks cannot compare at once, as
        the script's own error, not at the first check as a crash)."""
        self._recording = self._due(step) or not self._loop_checked
        if self._recording:
            self.own.record_first()

    def step_ended(self) -> None:
        """The first step ended without `step.gradients(model)`: nothing was ever compared."""
        if not self._loop_checked:
            raise SDKUsageError(
                "the spec asks for shadow checks (recovery.shadow_every), which compare the "
                "gradients in step.gradients(model): call it after backward, before the "
                "optimizer step; or set recovery.shadow_every = 0"
            )

    def after_backward(self, step: Step, model: torch.nn.Module) -> Verdict | None:
        """After the step's backward, before its optimizer step (the parameters the gradients
        came from): None when every pair agreed, or the step is not checked."""
        if not self._recording:
            return None
        module = plain_module(model)
        own, micro = self.own.first_fingerprint(module)
        if not self._loop_checked:
            _comparable(step, micro)
            self._loop_checked = True
        if not self._due(step.number):
            return None
        number = step.number
        checked = self._recompute(module, number, self.ring.target_of(self.run.rank))
        rows = gather_rows([*own, *checked])
        owns = [_fingerprint_at(row, 0) for row in rows]
        checks = [_fingerprint_at(row, 1) for row in rows]
        found = disagreements(self.ring, owns, checks, self.settings.rtol)
        ties: dict[tuple[int, int], Fingerprint] = {}
        needed = ties_needed(found, self.ring)
        if needed:  # the same on every rank: every rank joins the second gather or none does
            mine: list[float] = []
            for owner, checker in needed:
                # Under FSDP every rank joins the recompute (it gathers shards); the third's counts.
                third = self.ring.third(owner, checker) == self.run.rank
                joins = third or self.own.collective
                tie = self._recompute(module, number, owner) if joins else None
                mine += list(tie) if tie and third else [math.nan] * FINGERPRINT_SIZE
            rows = gather_rows(mine)
            for i, (owner, checker) in enumerate(needed):
                ties[(owner, checker)] = _fingerprint_at(rows[self.ring.third(owner, checker)], i)
        verdict = settle(number, found, self.ring, ties, self.settings.rtol)
        if verdict is None:
            self.unverified_since = number
            why = "suspect" if number == self._asked else "every"
            self.run._progress.write(event="shadow_check", step=number, agreed=True, why=why)
        return verdict

    def _recompute(self, module: torch.nn.Module, step: int, owner: int) -> Fingerprint:
        """The first micro-batch of `step` of the owner's tensor-parallel group (the owner's
        own, without tensor parallelism), drawing what this rank's counterpart there drew;
        this rank's own streams continue afterwards as if nothing had been drawn. Every rank
        of a group recomputes the same group's, so their collectives meet."""
        run = self.run
        assert run.sampler is not None
        tensor = run.layout.tensor
        group = owner // tensor  # its data-parallel rank: ranks are laid out tensor innermost
        counterpart = group * tensor + run.rank % tensor
        x, y = run.sampler.first_micro_batch(run.samples_seen, group)
        x, y = x.to(run.device), y.to(run.device)

        def loss() -> torch.Tensor:
            with run.autocast():  # as the script's forward runs (`Step.forward`)
                return self.loss_of(module, x, y)

        with forked(run.device):
            seed_step(run.device, run.settings.seed, step, group, counterpart, tensor > 1)
            return self.own.recompute(module, loss)


def shadow_checks(
    run: Run, settings: ShadowSettings, loss_of: Recompute | None, own: OwnGradients | None
) -> ShadowChecks | None:
    """The run's checks where the spec asks for them, or why the script cannot have them."""
    if settings.every == 0:
        return None
    if loss_of is None:
        raise SDKUsageError(
            f"the spec asks for a shadow recompute every {settings.every} steps "
            "(recovery.shadow_every): call run.recompute_with(loss_of) before run.steps(), "
            "loss_of(module, x, y) returning what the loop calls backward on for one "
            "micro-batch; or set recovery.shadow_every = 0"
        )
    if settings.rtol == 0 and run.device.type == "cuda":
        raise SDKUsageError(
            "the spec asks for bitwise shadow checks (recovery.shadow_rtol = 0), which GPUs "
            "cannot pass: their kernels (attention's backward, atomic adds) and a compiled "
            "model against its eager recompute differ in the last bits, so every pair would "
            "disagree and every node be quarantined. Set recovery.shadow_rtol (1e-3 is a "
            "start; bench/gpu_first_contact.sh measures the drift on your GPUs), or "
            "recovery.shadow_every = 0"
        )
    if run.layout.data_parallel < 2:
        run._say("shadow recompute needs two data-parallel ranks or more: not checking")
        return None
    if own is None:
        raise SDKUsageError(
            "shadow recompute compares data-parallel ranks' own gradients, seen before their "
            "reduction: it needs a DDP model, or an FSDP one (fully_shard, with any tensor "
            "parallelism inside it); or set recovery.shadow_every = 0"
        )
    return ShadowChecks(run, settings, loss_of, own)


def _fingerprint_at(row: list[float], at: int) -> Fingerprint:
    """The `at`-th fingerprint of a gathered row (a rank's fingerprints, one after another)."""
    total, magnitudes, squares = row[at * FINGERPRINT_SIZE : (at + 1) * FINGERPRINT_SIZE]
    return total, magnitudes, squares


def _comparable(step: Step, micro: int) -> None:
    """The script's loop is one the checks can compare: its data comes from
    `step.micro_batches()`, and its first micro-batch's backward is reduced alone."""
    if step.micro_index == 0:
        raise SDKUsageError(
            "a shadow check recomputes a micro-batch of step.micro_batches(), but this loop "
            "took none from it: train on what it hands out, or set recovery.shadow_every = 0"
        )
    if micro != 1:
        when = f"after micro-batch {micro}" if micro else "never"
        raise SDKUsageError(
            "a shadow check compares the gradients of the first micro-batch, but this loop's "
            f"first all-reduce came {when} (accumulating under DDP's model.no_sync() or FSDP's "
            "set_requires_gradient_sync(False)?): let every micro-batch's backward reduce, or "
            "set recovery.shadow_every = 0"
        )


def plain_module(model: torch.nn.Module) -> torch.nn.Module:
    """The module the checks differentiate: `model` without torch.compile's wrapper and DDP's.
    Under torch.compile a DDP model is an OptimizedModule around the DDP one, so a check that
    looked for DDP alone ran its recompute through DDP's forward, which left DDP's reducer
    waiting for a backward that never came ("Expected to have finished reduction" at the next
    step). An FSDP model is its own module."""
    # torch.compile's module is looked up only where torch.compile was used: importing it
    # costs a rank a second of its start.
    compiled = getattr(sys.modules.get("torch._dynamo.eval_frame"), "OptimizedModule", ())
    while True:
        if isinstance(model, compiled):
            model = model._orig_mod
        elif isinstance(model, DistributedDataParallel):
            model = model.module
        else:
            return model
