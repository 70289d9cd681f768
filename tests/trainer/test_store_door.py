"""A boxed run's store door (trainer.store_door, infra.store.door) over a real unix socket: the
run's keys of its own generation, fenced by the agent, and a file only from the run's folder."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from infra.errors import ObjectNotFound
from infra.store.door import DoorFenced, DoorRefused, DoorStore
from infra.store.local import LocalStore
from trainer.checkpoint_manifest import CheckpointManifest
from trainer.manifest import (
    CommitOutcome,
    commit_fenced,
    manifest_key,
    prune,
    record_generation,
)
from trainer.rollback_points import RollbackPoints
from trainer.run_identity import pinned
from trainer.store_door import DoorPolicy, StoreDoor, door_folder


@pytest.fixture
def store(tmp_path: Path) -> LocalStore:
    return LocalStore(tmp_path / "store")


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "node" / "runs" / "r1"
    folder.mkdir(parents=True)
    return folder


@pytest.fixture
def door(store: LocalStore, run_dir: Path, tmp_path: Path) -> Iterator[DoorStore]:
    policy = DoorPolicy("r1", 2, run_dir, readable=("datasets/snap/",))
    folder = door_folder(tmp_path / "node", "r1")
    with StoreDoor(store, policy, folder / "door.sock"):
        yield DoorStore(str(folder / "door.sock"))
    folder.rmdir()  # in the system's temporary folder, not the test's


def test_a_run_reads_and_writes_its_own_keys_of_its_own_generation(
    door: DoorStore, store: LocalStore, run_dir: Path
) -> None:
    store.put_bytes("datasets/snap/MANIFEST.json", b"{}")
    store.put_bytes("datasets/other/MANIFEST.json", b"{}")
    staged = run_dir / "gen-2" / "staging" / "__0_0.distcp"
    staged.parent.mkdir(parents=True)
    staged.write_bytes(b"weights" * 1000)

    door.put_file("runs/r1/checkpoints/step-10/gen-2/__0_0.distcp", staged)
    assert store.get_bytes("runs/r1/checkpoints/step-10/gen-2/__0_0.distcp") == staged.read_bytes()
    assert door.put_if_absent("runs/r1/attempts/gen-2.json", b"1")
    assert not door.put_if_absent("runs/r1/attempts/gen-2.json", b"2")
    assert door.get_bytes("runs/r1/attempts/gen-2.json") == b"1"
    assert door.list("runs/r1/checkpoints/") == ["runs/r1/checkpoints/step-10/gen-2/__0_0.distcp"]
    assert door.digest("runs/r1/attempts/gen-2.json")[0] == 1
    assert door.get_bytes("datasets/snap/MANIFEST.json") == b"{}"
    got = run_dir / "fetched"
    door.get_file("runs/r1/checkpoints/step-10/gen-2/__0_0.distcp", got)
    assert got.read_bytes() == staged.read_bytes()
    assert door.exists("runs/r1/attempts/gen-2.json") and not door.exists("runs/r1/nothing")
    with pytest.raises(ObjectNotFound):
        door.get_bytes("runs/r1/nothing")
    door.delete("runs/r1/checkpoints/step-10/gen-2/__0_0.distcp")

    refused = {
        "another run": lambda: door.get_bytes("runs/r2/attempts/gen-1.json"),
        "another dataset": lambda: door.get_bytes("datasets/other/MANIFEST.json"),
        "every run": lambda: door.list("runs/"),
        "its fences": lambda: door.put_bytes("runs/r1/generations/gen-3.json", b"{}"),
        "its logs": lambda: door.put_bytes("runs/r1/logs/gen-2/n0/rank-0.log", b"x"),
        "an older generation": lambda: door.put_bytes("runs/r1/attempts/gen-1.json", b"{}"),
        "a file from outside": lambda: door.put_file(
            "runs/r1/pins/step-1-gen-2.json", Path("/etc/hostname")
        ),
        "a fence deleted": lambda: door.delete("runs/r1/generations/gen-1.json"),
    }
    for what, attempt in refused.items():
        with pytest.raises(DoorRefused):
            attempt()
            pytest.fail(f"{what} was let through")
    assert not store.exists("runs/r1/generations/gen-3.json")


def test_once_a_later_generation_started_this_one_commits_nothing(
    door: DoorStore, store: LocalStore
) -> None:
    manifest = CheckpointManifest(run_id="r1", step=30, generation=2, files=[])
    key = manifest_key("r1", 30, 2)
    # Generation 3 resumed from step 20 while generation 2, paused, was still going to commit 30.
    record_generation(store, "r1", 3, 20)
    # As commit_fenced reports a manifest it took back itself: the rank stops, fenced.
    assert commit_fenced(door, key, manifest, "r1", "", 2, 30) is CommitOutcome.TAKEN_BACK
    assert not store.exists(key)
    with pytest.raises(DoorFenced, match="fenced: a later generation has started"):
        door.put_bytes("runs/r1/checkpoints/step-30/gen-2/__0_0.distcp", b"x")


def test_a_manifest_fenced_between_its_put_and_the_door_s_look_is_taken_back(
    store: LocalStore, run_dir: Path, tmp_path: Path
) -> None:
    """The fence read after the put, as commit_fenced reads it: the door's cached view of the
    fences said go, the fresh one after the put says a later generation resumed earlier."""
    policy = DoorPolicy("r1", 2, run_dir)
    folder = door_folder(tmp_path / "node", "r1")
    with StoreDoor(store, policy, folder / "door.sock") as agent:
        door = DoorStore(str(folder / "door.sock"))
        door.put_bytes("runs/r1/attempts/gen-2.json", b"{}")  # the door has looked at the fences
        record_generation(store, "r1", 3, 10)
        agent.fences(fresh=False)  # still the view from before, within its second
        manifest = CheckpointManifest(run_id="r1", step=30, generation=2, files=[])
        key = manifest_key("r1", 30, 2)
        with pytest.raises(DoorFenced, match="taken back: committed by generation 2 at step 30"):
            door.put_if_absent(key, manifest.dump_bytes())
        assert not store.exists(key)
    folder.rmdir()
    assert json.loads(store.get_bytes("runs/r1/generations/gen-3.json"))["resume_step"] == 10


def test_a_rank_keeps_an_earlier_generation_s_checkpoint_for_a_rollback(
    door: DoorStore, store: LocalStore
) -> None:
    """A suspect seen by generation 2 pins the checkpoints from before it, one of them
    committed by generation 1: the pin is filed under generation 2, the only one it may write."""
    key = manifest_key("r1", 10, 1)
    store.put_bytes(
        key, CheckpointManifest(run_id="r1", step=10, generation=1, files=[]).dump_bytes()
    )
    RollbackPoints(door, "r1", 2).suspect_at(20)
    assert pinned(store, "r1") == {key}
    assert prune(store, "r1", keep=0) == []  # kept for the rollback
