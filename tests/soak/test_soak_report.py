"""The soak's accounting (bench/soak_report.py) on attempts and progress lines made up to the
second: what each early end cost its run, and the failure model's terms against its prediction."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from bench.soak_plan import Interruption, RunFigures
from bench.soak_report import _model_scope, interruptions
from workflows.contracts.models import AttemptCause, AttemptOutcome, AttemptRecord

T0 = datetime(2026, 12, 7, tzinfo=UTC)


def attempt(
    generation: int, requested: float, granted: float, ended: float, outcome: AttemptOutcome,
    after: AttemptCause,
) -> AttemptRecord:  # fmt: skip
    def at(s: float) -> datetime:
        return T0 + timedelta(seconds=s)

    return AttemptRecord(generation=generation, gpus=2, requested_at=at(requested),
                         granted_at=at(granted), ended_at=at(ended), outcome=outcome,
                         after=after)  # fmt: skip


def stepped(first: int, last: int, at: float) -> dict[int, float]:
    """Steps first..last, one a second from `at` (progress lines carry epoch seconds)."""
    return {s: T0.timestamp() + at + (s - first) for s in range(first, last + 1)}


def test_each_early_end_costs_its_lost_steps_and_its_restart_less_any_queue() -> None:
    attempts = [
        attempt(1, 0, 1, 60, AttemptOutcome.FAILED, AttemptCause.START),
        # Failed before a step (the control plane was down): part of the restart.
        attempt(2, 60, 62, 70, AttemptOutcome.FAILED, AttemptCause.FAILURE),
        # Waited 5 s for a spare: a failure's restart includes it.
        attempt(3, 70, 75, 140, AttemptOutcome.PREEMPTED, AttemptCause.FAILURE),
        # Queued 30 s after the preemption, like any run: not the restart's.
        attempt(4, 140, 170, 300, AttemptOutcome.COMPLETED, AttemptCause.PREEMPTION),
    ]
    steps = {
        1: stepped(1, 50, at=5),  # last step 50 at 54 s; the last commit was at step 40
        2: {},
        3: stepped(41, 100, at=78),  # resumed at 41 (78 s); preempted after saving step 100
        4: stepped(101, 200, at=175),
    }
    found = [
        (i.outcome, i.lost_steps, round(i.restart_s, 6)) for i in interruptions(attempts, steps)
    ]
    assert found == [("failed", 10, 78 - 54), ("preempted", 0, 175 - 137 - 30)]


def test_the_model_s_terms_match_its_prediction_when_a_failure_loses_half_an_interval() -> None:
    """400 steps of 0.1 s, a save every 100 costing 0.5 s, one failure that lost 50 steps (half
    the interval) and restarted in 12 s, one preemption resumed in 6 s: the measured share of
    work is the model's, to first order."""
    figures = RunFigures(
        phase="EXPIRED", half_interval=50, step_s=0.1, gpus=2,
        lost_gpu_s={"checkpoint stall": 2 * 0.5 * 5},  # 4 periodic saves and the preemption's
        interruptions=[Interruption(outcome="failed", lost_steps=50, restart_s=12.0),
                       Interruption(outcome="preempted", lost_steps=0, restart_s=6.0)],
    )  # fmt: skip
    _model_scope(figures, kept=400, every=100)
    assert figures.scope_s == pytest.approx(40 + 2.5 + 5 + 12 + 6)
    assert figures.goodput_scope_measured == pytest.approx(40 / 65.5)
    assert figures.goodput_predicted == pytest.approx(figures.goodput_scope_measured, abs=0.03)
    # A failure that lost the whole interval is what the model does not expect: 8 points off.
    figures.interruptions[0].lost_steps = 100
    _model_scope(figures, kept=400, every=100)
    assert figures.goodput_predicted - figures.goodput_scope_measured > 0.03
