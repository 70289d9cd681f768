"""The control worker's `attempt_ledger` activity over a ledger that a rank's AttemptClock
wrote to the store: the kept mark is the named step's, or (kept_at_most) the newest commit at
or before it, which is how the workflow recounts an attempt whose newest checkpoint a later
gang could not use."""

from __future__ import annotations

from pathlib import Path

from temporalio.testing import ActivityEnvironment

from activities.control import ControlActivities
from infra.settings import Settings
from infra.store.local import LocalStore
from trainer.attempt_clock import AttemptClock
from workflows.contracts.models import AttemptLedger, AttemptLedgerInput


def ledger(control: ControlActivities, kept_step: int | None, at_most: bool) -> AttemptLedger:
    inp = AttemptLedgerInput(run_id="r", generation=1, kept_step=kept_step, kept_at_most=at_most)
    found = ActivityEnvironment().run(control.attempt_ledger, inp)
    assert found is not None
    return found


def test_the_kept_mark_is_the_named_step_s_or_the_newest_commit_at_or_before_it(
    tmp_path: Path,
) -> None:
    store = LocalStore(tmp_path / "store")
    control = ControlActivities(Settings(home=tmp_path, store_url=str(store.root)))
    clock = AttemptClock(store, "r", 1, resume_step=0, process_started_at=0.0, enabled=True)
    clock.ready(load_s=0.0)
    for step in range(1, 61):
        clock.step_done(step, train_s=1.0)
        if step in (20, 40, 60):
            clock.save_issued(step)
            clock.committed(step)
    clock.end("failed: a peer vanished")

    assert ledger(control, 40, at_most=False).kept.train_s == 40.0
    assert ledger(control, 50, at_most=False).kept is None  # no commit at 50
    assert ledger(control, 50, at_most=True).kept.step == 40
    assert ledger(control, 19, at_most=True).kept is None  # nothing kept at all
    newest = ledger(control, None, at_most=False)  # the workflow does not know: either tier's
    assert newest.last.step == 60 and newest.kept is None  # no manifest of either tier exists
