"""Goodput from a run's own attempts: every GPU-second put down to one cause, adding up."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from workflows.contracts.models import AttemptLedger, AttemptRecord, LedgerMark
from workflows.goodput import account

T0 = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def mark(seconds: float, step: int, **totals: float) -> LedgerMark:
    return LedgerMark(
        step=step,
        at=at(seconds).timestamp(),
        **{"train_s": 0.0, "stall_s": 0.0, "eval_s": 0.0, "straggler_s": 0.0, **totals},
    )


def failed_then_completed() -> list[AttemptRecord]:
    """Attempt 1 queues 5 s, starts in 3 s, keeps a checkpoint at 48 s, trains on to 55 s and
    dies; the gang is torn down at 60 s. Attempt 2 waits 4 s (backoff, new gang), restarts in
    3 s, finishes at 100 s, and its final save and exit take 4 s more. Two GPUs."""
    return [
        AttemptRecord(
            generation=1, gpus=2, requested_at=at(0), granted_at=at(5), ended_at=at(60),
            outcome="failed",
            ledger=AttemptLedger(
                resume_step=0, ready_at=at(8).timestamp(),
                kept=mark(48, 20, train_s=30, stall_s=2, eval_s=1, straggler_s=3),
                last=mark(55, 24, train_s=37, stall_s=2, eval_s=1, straggler_s=3),
            ),
        ),
        AttemptRecord(
            generation=2, gpus=2, requested_at=at(62), granted_at=at(64), ended_at=at(104),
            outcome="completed", after="failure",
            ledger=AttemptLedger(
                resume_step=20, ready_at=at(67).timestamp(),
                kept=mark(100, 40, train_s=30), last=mark(100, 40, train_s=30, stall_s=1.5),
            ),
        ),
    ]  # fmt: skip


def test_every_gpu_second_has_a_cause() -> None:
    goodput = account(failed_then_completed())
    assert goodput is not None
    assert goodput.gpu_s == 208 and goodput.allocated_gpu_s == 190
    assert goodput.productive_gpu_s == pytest.approx(114)  # (30 - 3) + 30 s, on 2 GPUs
    assert goodput.lost_gpu_s == pytest.approx(
        {
            "queue": 10,
            "startup": 6,
            "restart": 14,  # 4 s waiting for the new gang, 3 s starting it
            "checkpoint stall": 7,
            "evaluation": 2,
            "straggler": 6,
            "rework": 14,  # steps 21 to 24, whose checkpoint never came
            "failure detection": 10,
            "teardown": 5,
            "other": 20,
        }
    )
    assert goodput.productive_gpu_s + sum(goodput.lost_gpu_s.values()) == pytest.approx(208)
    assert goodput.goodput == pytest.approx(114 / 208)
    assert goodput.allocated_goodput == pytest.approx(114 / 190)


def test_an_attempt_that_never_trained_is_all_restart() -> None:
    first, second = failed_then_completed()
    never = AttemptRecord(
        generation=2, gpus=2, requested_at=at(61), granted_at=at(62), ended_at=at(64),
        outcome="failed", after="failure", ledger=None,
    )  # fmt: skip
    second = second.model_copy(update={"generation": 3})
    goodput = account([first, never, second])
    assert goodput is not None and goodput.attempts == 3
    assert goodput.lost_gpu_s["restart"] == pytest.approx(14)  # 60 → 71: the same seconds


def test_no_goodput_before_an_attempt_ends() -> None:
    running = failed_then_completed()[0].model_copy(update={"ended_at": None})
    assert account([running]) is None


@pytest.mark.parametrize(
    ("field", "cause"), [("shadow_s", "shadow recompute"), ("bubble_s", "pipeline bubble")]
)
def test_checks_and_a_pipeline_s_bubble_are_causes_of_their_own(field: str, cause: str) -> None:
    """Seconds the ranks spent on shadow checks, or idled in a pipeline's schedule (part of
    their step time), are not productive."""
    attempts = failed_then_completed()
    completed = attempts[1].ledger
    assert completed is not None
    completed.kept = mark(100, 40, train_s=30, **{field: 0.6})
    goodput = account(attempts)
    assert goodput is not None
    assert goodput.lost_gpu_s[cause] == pytest.approx(1.2)  # 0.6 s on 2 GPUs
    assert goodput.productive_gpu_s == pytest.approx(114 - 1.2)
    assert cause not in account(failed_then_completed()).lost_gpu_s
