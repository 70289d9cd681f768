"""What a run's status keeps of its past: bounded lists, totals and goodput over everything."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.workflows.test_goodput import at, failed_then_completed
from workflows.contracts.models import AttemptRecord, Failure, Phase, PreemptionRecord, RunStatus
from workflows.contracts.spec import RunSpec
from workflows.goodput import account
from workflows.run_records import (
    ATTEMPTS_KEPT,
    KEPT,
    add_attempt,
    add_failures,
    add_preemption,
    add_skipped,
    failed_in_a_row,
)


def _status() -> RunStatus:
    return RunStatus(name="r", phase=Phase.TRAINING, owner="ann", total_steps=10)


def _attempts(count: int) -> list[AttemptRecord]:
    """`count` attempts in a row, each a copy of the two-attempt story shifted in time."""
    out = []
    for i in range(count):
        template = failed_then_completed()[i % 2]
        shift = 110 * (i // 2)
        out.append(template.model_copy(update={
            "generation": i + 1,
            "requested_at": at(shift + (template.requested_at - at(0)).total_seconds()),
            "granted_at": at(shift + (template.granted_at - at(0)).total_seconds()),
            "ended_at": at(shift + (template.ended_at - at(0)).total_seconds()),
            "ledger": None if i % 3 == 2 else template.ledger,
        }))  # fmt: skip
    return out


@settings(max_examples=25, deadline=None)
@given(count=st.integers(1, 3 * ATTEMPTS_KEPT))
def test_goodput_counts_every_attempt_though_the_list_keeps_the_newest(count: int) -> None:
    attempts = _attempts(count)
    status = _status()
    for attempt in attempts:
        add_attempt(status, attempt)
    whole = account(attempts)
    assert status.gang_attempts == attempts[-ATTEMPTS_KEPT:]
    assert status.goodput is not None and whole is not None
    assert status.goodput.attempts == count
    assert status.goodput.gpu_s == pytest.approx(whole.gpu_s)
    assert status.goodput.productive_gpu_s == pytest.approx(whole.productive_gpu_s)
    assert status.goodput.lost_gpu_s == pytest.approx(whole.lost_gpu_s)


def test_failures_preemptions_and_skipped_checkpoints_keep_the_newest_and_a_total() -> None:
    status = _status()
    for generation in range(1, 3 * KEPT + 1):
        add_failures(status, [Failure(generation=generation, node_id="n0", reason="x", at=at(0))])
        add_preemption(status, PreemptionRecord(generation=generation, reason="y", at=at(0)))
        add_skipped(status, [f"step-{generation} torn", "step-1 torn"])
    assert status.failures_total == status.preemptions_total == 3 * KEPT
    assert [f.generation for f in status.failures] == list(range(2 * KEPT + 1, 3 * KEPT + 1))
    assert [p.generation for p in status.preemptions] == list(range(2 * KEPT + 1, 3 * KEPT + 1))
    assert len(status.skipped_checkpoints) == KEPT
    assert len(set(status.skipped_checkpoints)) == KEPT  # each reason once


def test_past_max_swaps_a_straggler_is_reported_and_kept() -> None:
    spec = RunSpec.model_validate({
        "name": "r", "data": {"sources": ["c.txt"]},
        "recovery": {"straggler_policy": "swap", "max_swaps": 2},
    })  # fmt: skip
    assert spec.after_swaps(1).recovery.straggler_policy == "swap"
    assert spec.after_swaps(2).recovery.straggler_policy == "report"
    assert spec.after_swaps(2).recovery.straggler_settings()["policy"] == "report"
    assert spec.recovery.straggler_policy == "swap"  # the run's own spec is unchanged


def test_only_failures_one_after_another_count_as_repeated() -> None:
    """The backoff before a restart grows with the failures in a row, not with the run's
    total: a run whose first failure comes after a completed or preempted attempt, or after an
    attempt that committed a checkpoint of its own, retries at once (TrainingRun._recover)."""
    status = _status()
    assert failed_in_a_row(status) == 0
    template = _attempts(1)[0]
    assert template.ledger is not None and template.ledger.kept is not None
    no_commit = template.ledger.model_copy(update={"kept": None})
    committed = template.ledger.model_copy(update={"resume_step": template.ledger.kept.step - 1})
    story = [("preempted", no_commit, 0), ("failed", no_commit, 1), ("failed", no_commit, 2),
             ("swapped", no_commit, 0), ("failed", no_commit, 1), ("failed", committed, 1),
             ("failed", no_commit, 2)]  # fmt: skip
    for outcome, ledger, want in story:
        add_attempt(status, template.model_copy(update={"outcome": outcome, "ledger": ledger}))
        assert failed_in_a_row(status) == want, (outcome, status.gang_attempts)
