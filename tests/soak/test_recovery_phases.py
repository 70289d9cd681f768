"""A node death's recovery split into its parts (bench/recovery_phases.py), on an attempt
record and progress lines made up to the second: the parts add up to the fault's recovery."""

from __future__ import annotations

from bench.recovery_phases import medians, phases
from bench.soak_plan import RecoveryPhases
from tests.soak.test_soak_report import T0, attempt
from workflows.contracts.models import AttemptCause, AttemptOutcome

EPOCH = T0.timestamp()


def line(at: float, event: str, **fields: object) -> dict:
    return {"time": EPOCH + at, "event": event, **fields}


def test_a_recovery_is_detect_regrant_launch_restore_and_first_step() -> None:
    attempts = [
        attempt(1, 0, 1, 64, AttemptOutcome.FAILED, AttemptCause.START),  # the fault at 60 s
        # Granted, then failed before a step (its node's agent was dead too): regrant's.
        attempt(2, 64, 65, 70, AttemptOutcome.FAILED, AttemptCause.FAILURE),
        attempt(3, 70, 72, 200, AttemptOutcome.COMPLETED, AttemptCause.FAILURE),
    ]
    events = {
        1: [line(5, "sdk", call="script", state="entered"), line(10, "step", step=1)],
        2: [],
        3: [
            line(75.5, "sdk", call="script", state="entered"),  # two ranks: the first counts
            line(76, "sdk", call="script", state="entered"),
            line(76, "sdk", call="restore", state="entered"),
            line(78, "sdk", call="restore", state="returned"),
            line(78.5, "step", step=41),
        ],
    }
    found = phases(EPOCH + 60, 1, attempts, events)
    assert found == RecoveryPhases(detect=4, regrant=8, launch=3.5, restore=2.5, first_step=0.5)
    assert found.total == 78.5 - 60  # what the soak's recovery figure counts for this fault


def test_a_run_that_never_trained_again_has_no_parts() -> None:
    attempts = [attempt(1, 0, 1, 64, AttemptOutcome.FAILED, AttemptCause.START)]
    assert phases(EPOCH + 60, 1, attempts, {1: [line(10, "step", step=1)]}) is None


def test_each_part_s_median() -> None:
    a = RecoveryPhases(detect=4, regrant=2, launch=3, restore=1, first_step=0.5)
    b = RecoveryPhases(detect=6, regrant=4, launch=5, restore=1, first_step=1.5)
    c = RecoveryPhases(detect=5, regrant=3, launch=9, restore=2, first_step=1.0)
    assert medians([a, b, c]) == {
        "detect": 5, "regrant": 3, "launch": 5, "restore": 1, "first_step": 1.0,
    }  # fmt: skip
