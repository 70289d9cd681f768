"""A short soak (bench/soak.py) on a stack of its own: two teams' runs while a seeded
schedule of mixed faults fires every ~20 s, then nothing may be lost."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.local_stack import LocalStack
from bench.soak import FINAL, run_soak
from bench.soak_plan import FaultKind, SoakPlan, SoakRecord, draw_faults
from bench.soak_report import print_report
from workflows.contracts.models import Phase

SEED = 106  # its three minutes draw every kind of fault (13 of them)
MINUTES = 3


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_a_short_soak_loses_nothing(tmp_path: Path) -> None:
    """Every run ends, nothing is booked twice, no committed checkpoint is lost, and every run
    that completed holds bitwise the weights of the fault-free run of its kind; the record on
    disk is the one the soak kept, to be replayed."""
    faults = draw_faults(SEED, MINUTES * 60, mean_interval_s=20, outage_s=10)
    plan = SoakPlan(
        seed=SEED, duration_s=MINUTES * 60, mean_interval_s=20, outage_s=10, steps=400,
        checkpoint_every=25, nodes=5, faults=faults,
    )  # fmt: skip
    # The schedule itself: the seed draws it, the same every time.
    assert faults == draw_faults(SEED, MINUTES * 60, mean_interval_s=20, outage_s=10)
    assert {f.kind for f in faults} == set(FaultKind)
    stack = LocalStack(tmp_path / "home", {})
    stack.up(plan.nodes)
    try:
        record = run_soak(stack, plan, tmp_path / "soak.json", wait_s=900)
    finally:
        stack.cli("down")
    print_report(record)
    report = record.report
    assert report is not None
    assert SoakRecord.load(tmp_path / "soak.json") == record

    assert sum(report.faults.values()) >= 5, report.faults
    assert report.probes is not None  # read from the stack's histories
    assert report.not_ended == []
    assert report.violations == []
    assert [c for run in report.runs.values() for c in run.lost_commits] == []
    for name, run in report.runs.items():
        assert Phase(run.phase) in FINAL, (name, run)
        if run.phase == Phase.FAILED:
            assert run.error, name  # failed for a reason it says
        else:
            assert run.bitwise is True, (name, run)
