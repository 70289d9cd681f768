"""A plain torchrun script (examples/byo/plain: its own DDP set-up, its own loader over a text
file, `torch.save` into `--out`, `--resume`), in real torchrun ranks with the node agent's
half (trainer.script_folder): its folder is committed while it runs, a SIGKILLed gang resumes
from the last commit and ends where an uninterrupted run does, and a stop request ends it at
its last commit."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest
import torch

from activities.control import _reference
from activities.script_folders import restore_script_folder, script_folder_watch
from tests.activities.test_node_health_check import train_input
from tests.conftest import REPO
from tests.trainer.conftest import Trainer
from tests.trainer.test_distributed_training import job_processes
from trainer.errors import RanksFailed
from trainer.folder_checkpoint import restore_folder
from trainer.job import TrainJob
from trainer.manifest import CommittedCheckpoint, find_latest
from trainer.progress_tail import ProgressTail
from trainer.script_folder import ScriptFolder
from workflows.contracts.models import NodeTrainInput
from workflows.contracts.spec import ResourcesSpec, TrainSpec

PLAIN = REPO / "examples" / "byo" / "plain"
STEPS = 400


def plain_spec(steps: int = STEPS, save_every: int = 100) -> TrainSpec:
    return TrainSpec(
        code=str(PLAIN),
        entrypoint="train.py",
        checkpoints="folder",
        # A save every 100 steps of batches of 32, watched every 0.05 s (plain_job): the
        # folder is quiet for a settle period between saves long before the run's end. With a
        # save every 40 and a node's 1 s polls, a run of a few seconds sometimes showed the
        # watch no quiet folder before its end, and the kill test found the run already done.
        argv=[
            "--out",
            "{checkpoint_dir}",
            "--steps",
            str(steps),
            "--save-every",
            str(save_every),
            "--batch",
            "32",
        ],
        resume_argv=["--resume"],
    )


def node_input(
    run_id: str, spec: TrainSpec, generation: int, resume: CommittedCheckpoint | None
) -> NodeTrainInput:
    """What the run's workflow hands the gang's first node (n0, the node of Trainer.job): the
    script's spec on two ranks, and the commit to resume from as the workflow refers to it."""
    base = train_input()
    run = base.spec.model_copy(
        update={"train": spec, "resources": ResourcesSpec(nodes=1, gpus_per_node=2)}
    )
    allocation = base.allocation.model_copy(update={"run_id": run_id, "generation": generation})
    return base.model_copy(
        update={
            "run_id": run_id,
            "spec": run,
            "allocation": allocation,
            "node_id": "n0",
            "resume": _reference(resume) if resume is not None else None,
        }
    )


def plain_job(
    trainer: Trainer,
    run_id: str,
    generation: int = 1,
    resume: CommittedCheckpoint | None = None,
    spec: TrainSpec | None = None,
) -> tuple[TrainJob, ScriptFolder]:
    """The job as a node agent hands it over (activities.script_folders): its folder restored
    from `resume` (or empty), its arguments filled in, and the watch that commits the folder."""
    spec = spec or plain_spec()
    inp = node_input(run_id, spec, generation, resume)
    job = trainer.job(run_id, spec, generation=generation, code_dir=str(PLAIN))
    workdir = Path(job.progress_file).parent
    job.stop_file = str(workdir / "STOP")  # as activities.node sets it
    restore_script_folder(trainer.store, inp, job)
    # Shorter than a node's settle period (SETTLE_S) and poll (POLL_S): the kill and stop tests
    # strike at the first commit, which must come while the script is still far from its end.
    folder = script_folder_watch(
        trainer.store, inp, job, workdir / "staging-of-folder", settle_s=0.2, poll_s=0.05
    )
    return job, folder


def final_state(trainer: Trainer, run_id: str, generation: int) -> tuple[int, dict]:
    """The run's last commit: its step, and the script's own checkpoint in it."""
    found = find_latest(trainer.store, run_id, max_generation=generation)
    assert found is not None and found.manifest.contents == "folder"
    folder = restore_folder(trainer.store, found.manifest, trainer.root / f"{run_id}-final")
    return found.step, torch.load(folder.path / "last.pt")


@pytest.fixture(scope="module")
def uninterrupted(trainer: Trainer) -> tuple[ProgressTail, int, dict]:
    """The script run to its end, fault-free: how the run ended, its last commit's step and
    the script's own checkpoint in it."""
    job, folder = plain_job(trainer, "plain-ref")
    tail = trainer.run(job, ranks=2, script_folder=folder)
    return (tail, *final_state(trainer, "plain-ref", 1))


def test_a_plain_script_runs_as_it_is_and_its_folder_is_committed(
    uninterrupted: tuple[ProgressTail, int, dict],
) -> None:
    tail, step, saved = uninterrupted
    assert tail.finished and tail.latest["state"] == "done"
    assert saved["step"] == STEPS  # the script's own step count, in its own file
    assert tail.latest["step"] == step >= 1  # the commits count the run's progress
    assert tail.exited == {0, 1}  # both ranks returned


def test_a_sigkilled_plain_script_resumes_from_its_last_commit_exactly(
    trainer: Trainer, uninterrupted: tuple[ProgressTail, int, dict]
) -> None:
    """Killed after its first commit, the gang's next generation gets the committed folder
    back and `--resume`, and the script ends with the weights of the uninterrupted run. What
    the killed gang left on its node (a file it may have been writing) is not what resumes."""
    whole = uninterrupted[2]
    job, folder = plain_job(trainer, "plain-killed")

    async def kill_after_the_first_commit() -> None:
        task = await trainer.start_until_committed(job, ranks=2, script_folder=folder)
        for pid in job_processes(Path(job.progress_file).parent / "job.json", launcher=True):
            os.kill(pid, signal.SIGKILL)
        with pytest.raises(RanksFailed):
            await task

    asyncio.run(kill_after_the_first_commit())
    Path(folder.folder, "last.pt").write_bytes(b"torn")  # as a kill mid-save leaves it
    committed = find_latest(trainer.store, "plain-killed", max_generation=1)
    assert committed is not None
    resumed_at = torch.load(
        restore_folder(trainer.store, committed.manifest, trainer.root / "at-kill").path / "last.pt"
    )["step"]
    assert 0 < resumed_at < STEPS

    job, folder = plain_job(trainer, "plain-killed", generation=2, resume=committed)
    assert job.script_argv[-1] == "--resume"
    tail = trainer.run(job, ranks=2, script_folder=folder)
    assert tail.latest["state"] == "done"
    log = (Path(job.progress_file).parent / "rank-0.log").read_text()
    assert f"resumed at step {resumed_at}" in log
    step, ended = final_state(trainer, "plain-killed", 2)
    assert step > committed.step  # the commits' count goes on from the last one
    assert ended["step"] == STEPS
    assert all(torch.equal(ended["model"][k], whole["model"][k]) for k in whole["model"])


def test_a_plain_script_asked_to_stop_ends_at_its_last_commit(trainer: Trainer) -> None:
    """A preemption: the ranks get a SIGTERM (this script has no handler, and dies of it), and
    the job says it stopped, at the step of its last commit; nothing the dying ranks left is
    committed after it."""
    job, folder = plain_job(trainer, "plain-stopped", spec=plain_spec(steps=100_000))

    async def stop_after_the_first_commit() -> ProgressTail:
        task = await trainer.start_until_committed(job, ranks=2, script_folder=folder)
        Path(job.stop_file).write_text("checkpoint and exit\n")
        return await task

    tail = asyncio.run(stop_after_the_first_commit())
    assert tail.stopped and tail.latest["stop_reason"] == "asked to stop"
    last = find_latest(trainer.store, "plain-stopped", max_generation=1)
    assert last is not None and tail.latest["step"] == last.step
    assert not tail.exited  # they died of the signal: no rank returned
