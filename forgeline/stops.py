"""Why a rank's loop ends at a step: what it is asked, what the straggler watch finds, and the
reason the gang gives when it stops.

Each rank forms its own request (`request`), the step's all-gather takes the strongest of the
gang's (trainer.step_share), and the straggler verdict (`judge`) is reached alike on every rank
from the same gathered times, so every rank stops, or not, at the same step.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from forgeline.findings import Findings
from forgeline.step import Step
from trainer.runtime import TermSignal
from trainer.spike_watch import SpikeWatch
from trainer.step_share import StepShare
from trainer.stop_reasons import (
    ASKED_TO_STOP,
    FENCED,
    KEEP_GOING,
    NON_FINITE,
    PREEMPTED,
    STOP_REASONS,
    STRAGGLER,
)
from trainer.stragglers import StragglerWatch

# What a job file without straggler settings means (a job written before they existed).
_DEFAULT_WATCH = {"window": 20, "factor": 1.5, "windows": 3}


class StopRules:
    """One rank's stop rules for one `run.steps()` loop."""

    def __init__(
        self,
        stragglers: dict,
        findings: Findings,
        ranks_per_node: int,
        term: TermSignal,
        stop_file: Path | None,
        spikes: SpikeWatch,
        on_suspect: Callable[[int], None] | None = None,
        peers: list[int] | None = None,
    ) -> None:
        self.watch = StragglerWatch(**stragglers.get("watch", _DEFAULT_WATCH), peers=peers)
        self.action = stragglers.get("policy", "report")  # off | report | swap
        self._findings = findings
        self._ranks_per_node = ranks_per_node
        self._term = term
        self._stop_file = stop_file
        self._spikes = spikes
        self._on_suspect = on_suspect  # a rank named at a step (not the run's own spikes)
        self._straggler = ""  # the last straggler's description, the reason a swap gives

    def request(self, step: Step, fenced: bool) -> int:
        """This rank's own reason to stop after `step`, strongest first."""
        if not step.finite:  # silent corruption or divergence: nothing from here on is saved
            return NON_FINITE
        if fenced:  # a later generation owns the run: commit nothing more
            return FENCED
        if self._term.received:
            return PREEMPTED
        if self._stop_file is not None and self._stop_file.exists():
            return ASKED_TO_STOP
        return KEEP_GOING

    def judge(
        self, step: int, shared: StepShare, own_step_s: float, stop: int
    ) -> tuple[int, float]:
        """The gang's stop after the straggler watch has seen this step, and the step time the
        gang lost to its slowest rank (for the goodput ledger). The suspect watch sees the
        step's gradient norms and losses too; what it finds is reported, and the gang goes on."""
        for spike in self._spikes.add(step, shared.grad_norm, shared.loss):
            self._findings.suspect(spike)
            if spike.rank is not None and self._on_suspect is not None:
                self._on_suspect(step)
        lost_before = self.watch.lost_s
        found = self.watch.add(step, shared.forward_s, own_step_s, gang_step_s=shared.step_s[0])
        if found is not None and self.action != "off":
            self._straggler = found.describe(self._ranks_per_node)
            self._findings.health("straggler", step, found.rank, self.action, self._straggler,
                                  ratio=found.ratio)  # fmt: skip
            if self.action == "swap":  # checkpoint now; the run goes on without it
                stop = max(stop, STRAGGLER)
        return stop, self.watch.lost_s - lost_before

    def reason(self, stop: int, fenced: bool) -> str:
        """What the generation's last progress line says about why it stopped."""
        if fenced:
            return STOP_REASONS[FENCED]
        if self._straggler and stop == STRAGGLER and self.action == "swap":
            return f"straggler: {self._straggler}"
        return STOP_REASONS[stop]
