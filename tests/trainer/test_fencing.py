"""Generation fencing: once a generation starts, older ones can commit nothing that counts."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from infra.digest import sha256_bytes
from infra.store.door import DoorStore
from infra.store.local import LocalStore
from infra.store.protocol import ObjectStore
from tests.trainer.conftest import Trainer
from tests.trainer.test_layouts import TRAIN
from trainer import store_door
from trainer.checkpoint import Checkpointer, fetch_checkpoint, load_model_weights
from trainer.checkpoint_manifest import CheckpointFile, CheckpointManifest
from trainer.manifest import (
    Fences,
    checkpoint_prefix,
    commits,
    committed_steps,
    counted,
    find_latest,
    generation_key,
    manifest_key,
    prune,
    record_generation,
)
from trainer.store_door import DoorPolicy, StoreDoor, door_folder


def commit(
    store: LocalStore, run: str, step: int, generation: int, former_layout: bool = False
) -> str:
    """A small but complete checkpoint: one file and its manifest; the manifest's key. With
    `former_layout`, as checkpoints were laid out before per-generation folders."""
    data = f"{run}-{step}-{generation}".encode()
    folder = checkpoint_prefix(run, step, generation)
    if former_layout:
        folder = folder.rsplit("/", 1)[0]
    key = f"{folder}/__0_0.distcp"
    store.put_bytes(key, data)
    manifest = CheckpointManifest(
        run_id=run, step=step, generation=generation, tokens_seen=step,
        files=[CheckpointFile(name="__0_0.distcp", key=key, bytes=len(data),
                              sha256=sha256_bytes(data))],
    )  # fmt: skip
    assert store.put_if_absent(f"{folder}/MANIFEST.json", manifest.dump_bytes())
    return f"{folder}/MANIFEST.json"


def test_a_late_commit_of_an_old_generation_is_never_used(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    commit(store, "r", 20, generation=1)
    record_generation(store, "r", 2, resume_step=20)  # generation 2 resumes from step 20
    commit(store, "r", 40, generation=1)  # a paused rank of generation 1 comes back and commits
    skipped: list[str] = []
    found = find_latest(store, "r", max_generation=2, on_skip=skipped.append)
    assert found is not None and found.step == 20
    assert skipped == [
        f"{manifest_key('r', 40, 1)}: committed by generation 1 at step 40, after generation 2 "
        "had resumed from step 20"
    ]
    commit(store, "r", 30, generation=2)  # generation 2's own commits count
    found = find_latest(store, "r", max_generation=2)
    assert found is not None and (found.step, found.generation) == (30, 2)


def test_a_run_resumed_from_an_earlier_step_continues_a_new_lineage(tmp_path: Path) -> None:
    """`forgeline resume --from 20` on a run that finished at step 60: its first gang starts
    at step 20, and once fenced there, the old lineage's later commits never count again."""
    store = LocalStore(tmp_path)
    for step in (20, 40, 60):
        commit(store, "r", step, generation=1)
    found = find_latest(store, "r", max_generation=4, at_most_step=20)
    assert found is not None and (found.step, found.generation) == (20, 1)
    assert find_latest(store, "r", max_generation=4, at_most_step=39).step == 20
    record_generation(store, "r", 4, resume_step=found.step)  # what the fenced look records
    found = find_latest(store, "r", max_generation=5)  # the next gang, after a failure
    assert found is not None and (found.step, found.generation) == (20, 1)
    commit(store, "r", 40, generation=4)  # the new lineage's own commit at an old step
    found = find_latest(store, "r", max_generation=5)
    assert found is not None and (found.step, found.generation) == (40, 4)
    assert [c.generation for c in counted(store, "r")] == [4, 1]  # step 60 of gen 1 is stale


def test_fences_say_when_a_generation_is_superseded(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    record_generation(store, "r", 3, resume_step=0)
    record_generation(store, "r", 5, resume_step=60)
    record_generation(store, "r", 5, resume_step=99)  # a retry: the first record stands
    fences = Fences.read(store, "r")
    assert fences.resume_steps == {3: 0, 5: 60}
    assert fences.superseded(3) and not fences.superseded(5)
    assert fences.why_stale(3, 60) is None and fences.why_stale(3, 61) is not None


def test_stale_manifests_never_count_toward_keep(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    commit(store, "r", 20, generation=1)
    record_generation(store, "r", 2, resume_step=20)
    commit(store, "r", 40, generation=1)
    commit(store, "r", 60, generation=1)
    assert prune(store, "r", keep=1) == [60, 40]  # the stale ones go; step 20 stays
    assert committed_steps(store, "r") == [20]


def test_a_superseded_gang_commits_nothing_more_and_stops(trainer: Trainer) -> None:
    """Real ranks of generation 1 keep training after generation 2 was recorded (as when their
    node was paused and came back): their next save uploads nothing, and they stop."""
    long = TRAIN.model_copy(update={"steps": 100_000, "checkpoint_every": 10})
    job = trainer.job("fenced", long, run_uid="u1")  # a run with an identity: fences are its own
    store = trainer.store

    async def fence_while_running():
        task = await trainer.start_until_committed(job, ranks=2)
        newest = committed_steps(store, "fenced")[0]
        record_generation(store, "fenced", 2, resume_step=newest, run_uid="u1")
        return await asyncio.wait_for(task, 120)

    tail = asyncio.run(fence_while_running())
    assert tail.stopped and tail.latest["stop_reason"] == "fenced"
    fences = Fences.read(store, "fenced")
    resume_step = fences.resume_steps[2]
    # Nothing after the fence counts. A save whose last check came just before the record was
    # written may still land (check, then put): it is stale, and the one after it never starts.
    late = [step for step in committed_steps(store, "fenced") if step > resume_step]
    assert late in ([], [resume_step + 10])
    assert all(fences.why_stale(1, step) for step in late)
    later = [
        k
        for k in store.list("runs/fenced/checkpoints/")
        if int(k.split("/step-")[1].split("/")[0]) > resume_step + 10
    ]
    assert later == []
    found = find_latest(store, "fenced", max_generation=2, run_uid="u1")
    assert found is not None and found.step == resume_step
    assert found.manifest.run_uid == "u1"  # the ranks stamp their run's identity


class ResumedDuringTheCommit(LocalStore):
    """A newer generation resumes (its fence record lands) between an older one's last fence
    check and its manifest: the older gang paused at that moment (SIGSTOP, a frozen host)."""

    def put_if_absent(self, key: str, data: bytes) -> bool:
        if key.endswith("/MANIFEST.json") and not self.exists(generation_key("r", 2)):
            record_generation(self, "r", 2, resume_step=0)
        return super().put_if_absent(key, data)


@pytest.mark.usefixtures("one_rank")
def test_a_commit_that_lands_after_a_newer_generation_resumed_is_taken_back(
    tmp_path: Path,
) -> None:
    """The e2e's paused node committed its in-flight checkpoint when it came back, after the
    new generation had resumed from an earlier step: stale for every reader, and in the way of
    the new generation's own commit at that step. Now it is taken back, and the save fenced."""
    store = ResumedDuringTheCommit(tmp_path / "store")
    saver = Checkpointer(store=store, staging_dir=tmp_path / "staging", run_id="r", generation=1,
                         keep=2, layout={}, asynchronous=False)  # fmt: skip
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        saver.save(model, optimizer, 10, {"tokens_seen": 10})
        report = saver.wait()
    finally:
        saver.close()
    assert report is not None and report.manifest_key is None and report.fenced and saver.fenced
    assert committed_steps(store, "r") == []  # the key is free for generation 2's step 10


class PausedAt(LocalStore):
    """Generation 1's rank stops at `moment` of its save (SIGSTOP, a frozen host) and the test's
    `meanwhile` runs there once, as what the rest of the cluster did while it was stopped."""

    def __init__(self, root: Path, moment: str) -> None:
        super().__init__(root)
        self.moment = moment
        self.meanwhile: Callable[[], None] | None = None

    def _reached(self, moment: str) -> None:
        if self.meanwhile is not None and moment == self.moment:
            meanwhile, self.meanwhile = self.meanwhile, None
            meanwhile()

    def put_file(self, key: str, path: Path) -> None:
        self._reached("upload")  # its fence check passed: no generation 2 yet
        super().put_file(key, path)

    def put_if_absent(self, key: str, data: bytes) -> bool:
        done = super().put_if_absent(key, data)
        if key.endswith("/MANIFEST.json"):
            self._reached("after its commit")  # before it reads the fence again
        return done

    def list(self, prefix: str) -> list[str]:
        if prefix.endswith("/checkpoints/"):
            self._reached("before its prune")  # committed, the fence read after it said go
        return super().list(prefix)


def saver(store: LocalStore, tmp_path: Path, generation: int) -> Checkpointer:
    return Checkpointer(store=store, staging_dir=tmp_path / f"staging-{generation}", run_id="r",
                        generation=generation, keep=2, layout={}, asynchronous=False)  # fmt: skip


def linear(seed: int) -> tuple[torch.nn.Linear, torch.optim.SGD]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 4)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


@contextlib.contextmanager
def generation_1_store(store: LocalStore, tmp_path: Path, boxed: bool) -> Iterator[ObjectStore]:
    """Generation 1's store: the store itself, or in a box its node agent's door, which
    refuses a fenced generation every write and delete."""
    if not boxed:
        yield store
        return
    run_dir = tmp_path / "node" / "runs" / "r"
    run_dir.mkdir(parents=True)
    folder = door_folder(tmp_path / "node", "r")
    with StoreDoor(store, DoorPolicy("r", 1, run_dir), folder / "door.sock"):
        yield DoorStore(str(folder / "door.sock"))
    folder.rmdir()


@pytest.mark.usefixtures("one_rank")
@pytest.mark.parametrize("boxed", [False, True], ids=["unboxed", "boxed"])
@pytest.mark.parametrize("moment", ["upload", "after its commit"])
def test_a_paused_older_generation_never_spoils_a_newer_one_s_commit_at_the_same_step(
    tmp_path: Path, moment: str, boxed: bool
) -> None:
    """Generation 1 stops in the middle of its save of step 10; generation 2 resumes from step
    0 and commits its own step 10; then generation 1 carries on. Before per-generation keys,
    at "upload" it overwrote generation 2's committed files (whose sha256 then failed: no
    checkpoint left), and "after its commit" its manifest held the key, so generation 2's
    commit of step 10 was refused (SaveReport.manifest_key None) and the step lost. Boxed, the
    clean-clone CI's paused-node e2e found its rank crashed (DoorFenced) deleting the uploads
    of a commit taken back: it stops fenced, and generation 2's next prune removes them."""
    store = PausedAt(tmp_path / "store", moment)
    new = saver(store, tmp_path, 2)
    (old_model, old_opt), (new_model, new_opt) = linear(1), linear(2)
    reports = []

    def generation_2_resumes_and_commits() -> None:
        record_generation(store, "r", 2, resume_step=0)
        new.save(new_model, new_opt, 10, {"tokens_seen": 10})
        reports.append(new.wait())

    store.meanwhile = generation_2_resumes_and_commits
    with generation_1_store(store, tmp_path, boxed) as its_store:
        old = Checkpointer(store=its_store, staging_dir=tmp_path / "node" / "runs" / "r" / "gen-1",
                           run_id="r", generation=1, keep=2, layout={},
                           asynchronous=False)  # fmt: skip
        try:
            old.save(old_model, old_opt, 10, {"tokens_seen": 10})
            late = old.wait()
        finally:
            old.close()
            new.close()
    (committed,) = reports
    assert committed is not None and committed.manifest_key == manifest_key("r", 10, 2)
    assert late is not None and late.manifest_key is None and late.fenced
    found = find_latest(store, "r", max_generation=2)
    assert found is not None and (found.step, found.generation) == (10, 2)
    folder = fetch_checkpoint(store, found.manifest, tmp_path / "fetched")
    loaded, _ = linear(3)
    load_model_weights(loaded, folder)
    assert torch.equal(loaded.weight, new_model.weight)
    if boxed:
        prune(store, "r", keep=2)  # generation 2's next commit
    assert store.list(checkpoint_prefix("r", 10, 1) + "/") == []  # nothing of it is left


@pytest.mark.usefixtures("one_rank")
def test_a_boxed_generation_superseded_between_its_commit_and_its_prune_stops_at_its_fence(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The clean-clone CI's paused-node e2e again: generation 1's commit of step 20 stood, then
    generation 2 resumed from step 10, and the door refused generation 1's prune of step 10.
    The prune is generation 2's now, and generation 1's next save finds the fence and stops."""
    monkeypatch.setattr(store_door, "FENCE_TTL_S", 0.0)  # a pause outlasts the door's cache
    store = PausedAt(tmp_path / "store", "before its prune")
    new = saver(store, tmp_path, 2)
    (old_model, old_opt), (new_model, new_opt) = linear(1), linear(2)

    def generation_2_resumes_and_commits() -> None:
        record_generation(store, "r", 2, resume_step=10)
        new.save(new_model, new_opt, 20, {"tokens_seen": 20})
        new.wait()

    with generation_1_store(store, tmp_path, boxed=True) as its_store:
        old = Checkpointer(store=its_store, staging_dir=tmp_path / "node" / "runs" / "r" / "gen-1",
                           run_id="r", generation=1, keep=1, layout={},
                           asynchronous=False)  # fmt: skip
        reports = []
        try:
            for step in (10, 20, 30):
                if step == 20:  # paused in its prune after the commit of step 20
                    store.meanwhile = generation_2_resumes_and_commits
                old.save(old_model, old_opt, step, {"tokens_seen": step})
                reports.append(old.wait())
        finally:
            old.close()
            new.close()
    committed, late = reports[1], reports[2]
    assert committed is not None and committed.manifest_key == manifest_key("r", 20, 1)
    assert late is not None and late.manifest_key is None and late.fenced
    found = find_latest(store, "r", max_generation=2)
    assert found is not None and (found.step, found.generation) == (20, 2)


def test_pruning_removes_what_a_fenced_out_generation_uploaded_but_never_committed(
    tmp_path: Path,
) -> None:
    store = LocalStore(tmp_path)
    commit(store, "r", 10, generation=1)
    store.put_bytes(f"{checkpoint_prefix('r', 20, 1)}/__0_0.distcp", b"torn by the fence")
    record_generation(store, "r", 2, resume_step=10)
    store.put_bytes(f"{checkpoint_prefix('r', 20, 2)}/__0_0.distcp", b"generation 2 uploading")
    assert prune(store, "r", keep=2) == []
    assert store.list("runs/r/checkpoints/step-20/") == [
        f"{checkpoint_prefix('r', 20, 2)}/__0_0.distcp"  # the current generation's is its own
    ]
    assert committed_steps(store, "r") == [10]


def test_checkpoints_of_the_former_layout_still_resume_and_prune(tmp_path: Path) -> None:
    """Written before per-generation folders: files and manifest directly in step-<n>/."""
    store = LocalStore(tmp_path)
    commit(store, "r", 10, generation=1, former_layout=True)
    legacy = commit(store, "r", 20, generation=1, former_layout=True)
    found = find_latest(store, "r", max_generation=1)
    assert found is not None and found.key == legacy == "runs/r/checkpoints/step-20/MANIFEST.json"
    record_generation(store, "r", 2, resume_step=10)  # say step 20 did not resume, and is stale
    ours = commit(store, "r", 20, generation=2)
    assert [(c.step, c.generation) for c in commits(store, "r")] == [
        (20, 2),
        (20, None),
        (10, None),
    ]
    assert prune(store, "r", keep=1) == [20, 10]
    assert set(store.list("runs/r/checkpoints/")) == {
        f"{checkpoint_prefix('r', 20, 2)}/__0_0.distcp",
        ours,
    }
    found = find_latest(store, "r", max_generation=2)
    assert found is not None and (found.step, found.generation) == (20, 2)
