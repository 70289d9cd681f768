"""A run's checkpoints are its own, not its name's (issue 17, item 4): a second run of the same
name (the name reused after Temporal forgot the first, or another stack on the same bucket) is
refused before it resumes from or prunes the first's checkpoints, and a registered checkpoint
is never pruned. Through the control worker's `latest_checkpoint` activity, which every gang
attempt calls before its ranks start, on a real local store."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from activities.control import ControlActivities
from infra.settings import Settings
from infra.store.local import LocalStore
from tests.trainer.test_fencing import commit
from trainer.manifest import committed_steps, find_latest, prune
from trainer.run_identity import pin
from workflows.contracts.models import LatestCheckpointInput


def _stamp(store: LocalStore, key: str, run_uid: str) -> None:
    """What the ranks of a run with an identity commit: the manifest carries it."""
    manifest = json.loads(store.get_bytes(key))
    store.delete(key)
    store.put_if_absent(key, json.dumps({**manifest, "run_uid": run_uid}).encode())


def _latest(control: ControlActivities, run_uid: str, generation: int = 1):
    inp = LatestCheckpointInput(
        run_id="shared", max_generation=generation, fence=True, run_uid=run_uid
    )
    return ActivityEnvironment().run(control.latest_checkpoint, inp)


def test_a_second_run_of_a_name_never_resumes_from_the_first_runs_weights(
    tmp_path: Path,
) -> None:
    store = LocalStore(tmp_path / "store")
    control = ControlActivities(Settings(home=tmp_path, store_url=str(store.root)))
    assert _latest(control, "first") is None  # the first run claims runs/shared/
    _stamp(store, commit(store, "shared", 10, generation=1), "first")
    assert _latest(control, "first", generation=2).step == 10  # its own restart resumes

    # Before: the second run resumed from the first one's step 10 and went on to prune it.
    with pytest.raises(ApplicationError, match="belongs to another run of that name") as err:
        _latest(control, "second")
    assert err.value.non_retryable and "Submit under another name" in str(err.value)
    assert committed_steps(store, "shared") == [10]


def test_checkpoints_from_before_identities_are_not_taken_by_a_new_run(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    control = ControlActivities(Settings(home=tmp_path, store_url=str(store.root)))
    commit(store, "shared", 10, generation=1)  # a run from before identities: no claim
    with pytest.raises(ApplicationError, match="already holds checkpoints of an earlier run"):
        _latest(control, "new")
    assert _latest(control, "").step == 10  # that older run itself still resumes


def test_resume_and_pruning_pass_over_another_runs_manifest(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    mine = commit(store, "shared", 10, generation=1)
    _stamp(store, mine, "mine")
    _stamp(store, commit(store, "shared", 20, generation=1), "theirs")
    skipped: list[str] = []
    found = find_latest(store, "shared", 1, skipped.append, run_uid="mine")
    assert found is not None and found.step == 10
    assert skipped == [f"{found.key.replace('step-10', 'step-20')}: another run's (run_uid theirs)"]
    _stamp(store, commit(store, "shared", 30, generation=1), "mine")
    assert prune(store, "shared", keep=1, run_uid="mine") == [10]  # 20 is not its to delete
    assert committed_steps(store, "shared") == [30, 20]


def test_a_registered_checkpoint_is_never_pruned(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    registered = commit(store, "r", 10, generation=1)
    pin(store, "r", registered, 10, 1)
    commit(store, "r", 20, generation=1)
    commit(store, "r", 30, generation=1)
    # Before: keep = 1 deleted steps 20 and 10, the weights a model version points at.
    assert prune(store, "r", keep=1) == [20]
    assert committed_steps(store, "r") == [30, 10]
    assert find_latest(store, "r", 1).step == 30  # resume still takes the newest
