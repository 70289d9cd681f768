"""Generation fencing: once a generation starts, older ones can commit nothing that counts."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from infra.digest import sha256_bytes
from infra.store import LocalStore
from tests.trainer.conftest import Trainer
from tests.trainer.test_layouts import TRAIN
from trainer.checkpoint import Checkpointer
from trainer.manifest import (
    MANIFEST_FORMAT,
    Fences,
    committed_steps,
    find_latest,
    generation_key,
    manifest_key,
    prune,
    record_generation,
)


def commit(store: LocalStore, run: str, step: int, generation: int) -> None:
    """A small but complete checkpoint: one file and its manifest."""
    data = f"{run}-{step}-{generation}".encode()
    key = f"runs/{run}/checkpoints/step-{step}/__0_0.distcp"
    store.put_bytes(key, data)
    manifest = {
        "format": MANIFEST_FORMAT, "run_id": run, "step": step, "generation": generation,
        "tokens_seen": step,
        "files": [{"name": "__0_0.distcp", "key": key, "bytes": len(data),
                   "sha256": sha256_bytes(data)}],
    }  # fmt: skip
    assert store.put_if_absent(manifest_key(run, step), json.dumps(manifest).encode())


def test_a_late_commit_of_an_old_generation_is_never_used(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    commit(store, "r", 20, generation=1)
    record_generation(store, "r", 2, resume_step=20)  # generation 2 resumes from step 20
    commit(store, "r", 40, generation=1)  # a paused rank of generation 1 comes back and commits
    skipped: list[str] = []
    found = find_latest(store, "r", max_generation=2, on_skip=skipped.append)
    assert found is not None and found.step == 20
    assert skipped == [
        f"{manifest_key('r', 40)}: committed by generation 1 at step 40, after generation 2 "
        "had resumed from step 20"
    ]
    commit(store, "r", 30, generation=2)  # generation 2's own commits count
    found = find_latest(store, "r", max_generation=2)
    assert found is not None and (found.step, found.generation) == (30, 2)


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
    job = trainer.job("fenced", long)
    store = trainer.store

    async def fence_while_running():
        task = await trainer.start_until_committed(job, ranks=2)
        record_generation(store, "fenced", 2, resume_step=committed_steps(store, "fenced")[0])
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
    found = find_latest(store, "fenced", max_generation=2)
    assert found is not None and found.step == resume_step


class ResumedDuringTheCommit(LocalStore):
    """A newer generation resumes (its fence record lands) between an older one's last fence
    check and its manifest: the older gang paused at that moment (SIGSTOP, a frozen host)."""

    def put_if_absent(self, key: str, data: bytes) -> bool:
        if key.endswith("/MANIFEST.json") and not self.exists(generation_key("r", 2)):
            record_generation(self, "r", 2, resume_step=0)
        return super().put_if_absent(key, data)


@pytest.fixture
def one_rank(tmp_path: Path) -> Iterator[None]:
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


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
