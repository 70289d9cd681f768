"""Which checkpoint a new gang resumes from, through the control worker's `latest_checkpoint`
activity: a peer-tier checkpoint newer than the store's, with the store's as its fallback, and
the fence at the step it resumes from; never for `resume --from` or an evaluation."""

from __future__ import annotations

from pathlib import Path

from temporalio.testing import ActivityEnvironment

from activities.control import ControlActivities
from infra.settings import Settings
from infra.store.local import LocalStore
from tests.trainer.test_fencing import commit
from trainer.checkpoint_manifest import CheckpointManifest
from trainer.manifest import Fences, record_generation
from trainer.peer_tier import write_peer_manifest
from workflows.contracts.models import CheckpointRef, FenceInput, LatestCheckpointInput


def peer_commit(store: LocalStore, step: int, generation: int) -> str | None:
    manifest = CheckpointManifest(run_id="r", step=step, generation=generation, tokens_seen=step,
                                  files=[])  # fmt: skip
    return write_peer_manifest(store, manifest, "r", step, generation, run_uid="")


def latest(
    control: ControlActivities, generation: int, fence: bool = True, at_most: int | None = None
) -> CheckpointRef | None:
    inp = LatestCheckpointInput(run_id="r", max_generation=generation, fence=fence,
                                at_most_step=at_most)  # fmt: skip
    return ActivityEnvironment().run(control.latest_checkpoint, inp)


def test_a_new_gang_resumes_from_a_newer_peer_checkpoint_with_the_store_s_as_fallback(
    tmp_path: Path,
) -> None:
    store = LocalStore(tmp_path / "store")
    control = ControlActivities(Settings(home=tmp_path, store_url=str(store.root)))
    stored = commit(store, "r", 100, generation=1)
    assert peer_commit(store, 120, generation=1) == "runs/r/peer/step-120/gen-1/MANIFEST.json"

    # Not for an evaluation or `resume --from`: those read the store tier.
    assert latest(control, 1, fence=False).tier == "store"
    assert latest(control, 1, at_most=200).manifest_key == stored

    found = latest(control, 2)
    assert found is not None and (found.tier, found.step) == ("peer", 120)
    assert found.fallback is not None and found.fallback.manifest_key == stored
    # Fenced at the step it resumes from: generation 1 may have committed up to 120.
    assert Fences.read(store, "r").resume_steps[2] == 120


def test_a_store_checkpoint_at_least_as_new_wins_and_a_stale_peer_one_is_passed_over(
    tmp_path: Path,
) -> None:
    store = LocalStore(tmp_path / "store")
    control = ControlActivities(Settings(home=tmp_path, store_url=str(store.root)))
    peer_commit(store, 100, generation=1)
    commit(store, "r", 100, generation=1)
    assert latest(control, 2).tier == "store"

    # Generation 2 resumed from 100; generation 1, paused, committed a peer checkpoint later.
    record_generation(store, "r", 3, resume_step=100)
    assert peer_commit(store, 110, generation=1) is None  # taken back at once
    assert store.list("runs/r/peer/") == ["runs/r/peer/step-100/gen-1/MANIFEST.json"]
    found = latest(control, 3)
    assert found is not None and (found.tier, found.step) == ("store", 100)


def test_with_no_store_checkpoint_yet_the_fallback_is_the_start(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    control = ControlActivities(Settings(home=tmp_path, store_url=str(store.root)))
    peer_commit(store, 30, generation=1)
    found = latest(control, 2)
    assert found is not None and (found.tier, found.step, found.fallback) == ("peer", 30, None)


def test_the_lookup_for_a_new_gang_fences_nothing_and_the_fence_is_its_own_activity(
    tmp_path: Path,
) -> None:
    """Runs since the fence was split off look up (peer tier included) and fence in two
    activities; the lookup alone records no generation."""
    store = LocalStore(tmp_path / "store")
    control = ControlActivities(Settings(home=tmp_path, store_url=str(store.root)))
    commit(store, "r", 100, generation=1)
    peer_commit(store, 120, generation=1)
    inp = LatestCheckpointInput(run_id="r", max_generation=2, for_new_gang=True)
    found = ActivityEnvironment().run(control.latest_checkpoint, inp)
    assert found is not None and (found.tier, found.step) == ("peer", 120)
    assert 2 not in Fences.read(store, "r").resume_steps
    fence = FenceInput(run_id="r", generation=2, resume_step=found.step)
    ActivityEnvironment().run(control.fence_generation, fence)
    ActivityEnvironment().run(control.fence_generation, fence)  # a retry finds it there
    assert Fences.read(store, "r").resume_steps[2] == 120
