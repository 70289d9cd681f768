"""The node agent's part in a run whose script keeps its own checkpoints
(activities/script_folders.py): the folder restored from the run's last commit, or made empty,
the script's arguments, which node commits, and the workflow's rule for the end of such a run.
The whole path, torchrun ranks included, is tests/trainer/test_script_folder.py."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from activities.script_folders import restore_script_folder, script_folder_watch
from infra.store.local import LocalStore
from tests.activities.test_node_health_check import train_input
from trainer.errors import CheckpointError
from trainer.folder_checkpoint import CommitTarget
from trainer.folder_watch import FolderState, FolderWatcher
from trainer.job import TrainJob
from trainer.manifest import find_latest
from workflows.contracts.models import CheckpointRef, NodeTrainInput, NodeTrainResult
from workflows.contracts.spec import RunSpec
from workflows.gang_outcome import reached_the_end

FOLDER_RUN = {
    "name": "r",
    "data": {"sources": ["corpus.txt"]},
    "train": {
        "code": "plain",
        "entrypoint": "train.py",
        "checkpoints": "folder",
        "argv": ["--out", "{checkpoint_dir}"],
        "resume_argv": ["--resume"],
    },
}


def folder_input(node_id: str, resume: CheckpointRef | None = None) -> NodeTrainInput:
    spec = RunSpec.model_validate(FOLDER_RUN)
    return train_input().model_copy(update={"spec": spec, "node_id": node_id, "resume": resume})


def job_on(tmp_path: Path, node_id: str) -> TrainJob:
    work = tmp_path / node_id / "gen-3"
    work.mkdir(parents=True)
    return TrainJob(
        run_id="r", node_id=node_id, generation=3, model={}, train={}, train_shards=[],
        dtype="uint16", store_url="", staging_dir="", progress_file=str(work / "progress.jsonl"),
        stop_file=str(work / "STOP"),
    )  # fmt: skip


def committed_folder(store: LocalStore, tmp_path: Path) -> CheckpointRef:
    """A script's folder as a gang before committed it, at step 4."""
    folder = tmp_path / "earlier"
    folder.mkdir()
    watcher = FolderWatcher(folder, tmp_path / "staging", store, CommitTarget("r", 2), 3, 0.0)
    (folder / "last.pt").write_bytes(b"weights at step 4")
    assert watcher.final().state is FolderState.COMMITTED
    found = find_latest(store, "r", max_generation=2)
    assert found is not None
    return CheckpointRef(manifest_key=found.key, step=found.step, generation=2, tokens_seen=0)


def test_a_first_gang_starts_with_an_empty_folder_and_its_arguments(tmp_path: Path) -> None:
    job = job_on(tmp_path, "n0")
    stale = Path(job.progress_file).parent / "checkpoint"
    stale.mkdir()
    (stale / "last.pt").write_bytes(b"left by a gang that never committed")
    restore_script_folder(LocalStore(tmp_path / "store"), folder_input("n0"), job)
    assert job.checkpoint_folder == str(stale) and not any(stale.iterdir())
    assert job.script_argv == ["--out", str(stale)] and not job.checkpoint_resumed


def test_a_restarted_gang_gets_the_last_commit_back_and_is_told_to_resume(
    tmp_path: Path,
) -> None:
    store = LocalStore(tmp_path / "store")
    resume = committed_folder(store, tmp_path)
    job = job_on(tmp_path, "n1")
    restore_script_folder(store, folder_input("n1", resume), job)
    folder = Path(job.checkpoint_folder)
    assert (folder / "last.pt").read_bytes() == b"weights at step 4"
    assert job.checkpoint_resumed and job.script_argv == ["--out", str(folder), "--resume"]


def test_a_checkpoint_of_the_sdk_is_not_a_script_s_folder(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    resume = committed_folder(store, tmp_path)
    manifest = store.get_bytes(resume.manifest_key).replace(b'"contents": "folder",', b"")
    sdk_key = resume.manifest_key.replace("step-4", "step-5")
    store.put_bytes(sdk_key, manifest)
    sdk = resume.model_copy(update={"manifest_key": sdk_key})
    with pytest.raises(CheckpointError, match="holds the SDK's checkpoint, not a script's folder"):
        restore_script_folder(store, folder_input("n1", sdk), job_on(tmp_path, "n1"))


def test_only_the_gang_s_first_node_commits(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    watches = {}
    for node in ("n0", "n1"):
        job = job_on(tmp_path, node)
        restore_script_folder(store, folder_input(node), job)
        watches[node] = script_folder_watch(store, folder_input(node), job, tmp_path / "s" / node)
    assert watches["n0"].watcher is not None and watches["n1"].watcher is None


def test_a_script_s_run_ends_when_its_ranks_return_not_at_train_steps() -> None:
    folder, sdk = RunSpec.model_validate(FOLDER_RUN).train, train_input().spec.train
    result = NodeTrainResult(node_id="n0", generation=1, final_step=3, final_loss=None)
    assert not reached_the_end(folder, result) and not reached_the_end(sdk, result)
    done = result.model_copy(update={"finished": True})
    assert reached_the_end(folder, done) and not reached_the_end(sdk, done)
    at_steps = result.model_copy(update={"final_step": sdk.steps})
    assert reached_the_end(sdk, at_steps) and not reached_the_end(folder, at_steps)


def test_a_node_that_commits_nothing_ends_at_the_gang_s_step_not_at_zero(tmp_path: Path) -> None:
    """The gang's other nodes commit nothing; their end line says the step the gang resumed
    from, or the newest their ranks reported, as the first node's does."""
    store = LocalStore(tmp_path / "store")
    resume = committed_folder(store, tmp_path)  # at step 4
    job = job_on(tmp_path, "n1")
    inp = folder_input("n1", resume)
    restore_script_folder(store, inp, job)
    watch = script_folder_watch(store, inp, job, tmp_path / "s")
    assert watch.watcher is None

    def last_line() -> dict:
        return json.loads(Path(job.progress_file).read_text().splitlines()[-1])

    asyncio.run(watch.end(whole=True, stopped=False))
    assert last_line()["event"] == "done" and last_line()["step"] == 4
    watch.heard(SimpleNamespace(reported_step=9, losses=[], evaluated=None, saved_step=None))
    asyncio.run(watch.end(whole=True, stopped=True))
    assert last_line()["event"] == "stopped" and last_line()["step"] == 9
