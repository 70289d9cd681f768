"""`forgeline.report(step, **metrics)` (forgeline/reporting.py): the one call of a script that
otherwise never imports Forgeline. In this process, against a job file as the agent writes it:
the lines it appends are those the agent's tail, heartbeats and metric tap follow; bad calls are
refused before anything is written; only local rank 0 writes; at home it writes nothing. Then
in real torchrun ranks: examples/byo/plain with a report every 10 steps."""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import forgeline
from activities.metric_tap import MetricTap
from forgeline.reporting import this_process
from registry.metric_stream import MetricSpool
from tests.trainer.conftest import Trainer
from tests.trainer.test_script_folder import PLAIN, plain_job, plain_spec
from trainer import entry
from trainer.job import TrainJob
from trainer.manifest import find_latest
from trainer.progress_events import EvalLine, StepLine, progress_line
from trainer.progress_tail import ProgressTail
from trainer.reported_eval import reported_evaluation


@pytest.fixture(autouse=True)
def a_fresh_process(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """What a new rank process starts with: no reports yet, the script not begun, no job."""
    monkeypatch.setattr(entry._Progress, "began", False)
    monkeypatch.delenv("FORGELINE_JOB", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    this_process.cache_clear()
    yield
    this_process.cache_clear()


def in_a_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, local_rank: int = 0) -> Path:
    """This process as a rank of a job the agent started; returns its progress file."""
    progress = tmp_path / "progress.jsonl"
    job = TrainJob(run_id="r", node_id="n0", generation=1, model={}, train={},
                   train_shards=[], dtype="uint16", store_url=f"file://{tmp_path / 'store'}",
                   staging_dir=str(tmp_path / "staging"), progress_file=str(progress))  # fmt: skip
    monkeypatch.setenv("FORGELINE_JOB", str(job.write(tmp_path / "job.json")))
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    return progress


def written(progress: Path) -> list[dict]:
    return [json.loads(line) for line in progress.read_text().splitlines()]


def test_a_report_is_a_step_line_the_agent_and_mlflow_follow(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    progress = in_a_job(tmp_path, monkeypatch)
    forgeline.report(10, loss=2.5, lr=1e-3, grad_norm=0.75)
    forgeline.report(20, loss=2.25, val_loss=2.5)
    forgeline.report(20, val_loss=2.4)  # an evaluation of a step already reported: its line only

    lines = [progress_line(line.encode()) for line in progress.read_text().splitlines()]
    assert [(type(line), line.step if isinstance(line, StepLine) else None) for line in lines] == [
        (StepLine, 10), (StepLine, 20), (EvalLine, None), (EvalLine, None),
    ]  # fmt: skip
    assert written(progress)[0]["metrics"] == {"grad_norm": 0.75}  # as step.report's metrics
    assert entry._Progress.began  # a failure from here on is a crash, not the user's error

    tail = ProgressTail(progress)
    tail.poll()
    assert tail.latest["step"] == 20 and tail.latest["loss"] == 2.25
    assert tail.latest["lr"] == 1e-3 and tail.latest["val_loss"] == 2.4

    spool = MetricSpool(tmp_path / "spool", "mlflowrun", "g1-a1")
    MetricTap(progress, spool).drain()
    spool.close()
    points = {(p["key"], p["step"], p["value"]) for p in map(json.loads, spool.path.open())}
    assert points == {
        ("train/loss", 10, 2.5), ("train/lr", 10, 1e-3), ("train/grad_norm", 10, 0.75),
        ("train/loss", 20, 2.25), ("train/val_loss", 20, 2.5), ("train/val_loss", 20, 2.4),
    }  # fmt: skip


BAD_CALLS = {
    "a negative step": ((-1,), {}, "from 0 up"),
    "a float step": ((1.5,), {}, "whole number"),
    "a bool step": ((True,), {}, "whole number"),
    "a bool metric": ((1,), {"loss": True}, "is a number"),
    "a tensor metric": ((1,), {"loss": torch.tensor(2.0)}, ".item()"),
    "a text metric": ((1,), {"loss": "2.0"}, "is a number"),
    "a NaN": ((1,), {"loss": math.nan}, "must be finite"),
    "an infinity": ((1,), {"grad_norm": -math.inf}, "must be finite"),
    "a name with a space": ((1,), {"my loss": 1.0}, "letters, digits"),
    "a name too long": ((1,), {"x" * 201: 1.0}, "1-200"),
}


@pytest.mark.parametrize("case", sorted(BAD_CALLS))
def test_a_bad_call_is_refused_naming_the_fix_and_writes_nothing(
    case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    args, metrics, fix = BAD_CALLS[case]
    progress = in_a_job(tmp_path, monkeypatch)
    with pytest.raises(forgeline.SDKUsageError, match=fix):
        forgeline.report(*args, **metrics)
    assert not progress.exists() or not progress.read_text()
    assert not entry._Progress.began


def test_steps_must_not_go_backwards(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    progress = in_a_job(tmp_path, monkeypatch)
    forgeline.report(20, loss=1.0)
    forgeline.report(20, loss=0.9)  # the same step again is fine
    with pytest.raises(forgeline.SDKUsageError, match="must not go backwards"):
        forgeline.report(19, loss=0.8)
    assert [line["step"] for line in written(progress)] == [20, 20]


def test_only_local_rank_0_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every rank may call it: one node's lines are written once. The others still check
    their calls and count as begun."""
    progress = in_a_job(tmp_path, monkeypatch, local_rank=1)
    forgeline.report(10, loss=2.0)
    assert not progress.exists() or not progress.read_text()
    assert entry._Progress.began
    with pytest.raises(forgeline.SDKUsageError):
        forgeline.report(5, loss=2.0)


def test_at_home_it_writes_nothing_and_returns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Plain torchrun, no FORGELINE_JOB: the same script runs unchanged; a bad call fails at
    home as it would in a job."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert forgeline.report(10, loss=2.0, val_loss=2.1) is None
    assert list(tmp_path.iterdir()) == []
    assert not entry._Progress.began  # there is no rank entry to tell
    with pytest.raises(forgeline.SDKUsageError, match="must be finite"):
        forgeline.report(11, loss=math.inf)


REPORTING = (
    "        if rank == 0 and step % 10 == 0:\n"
    "            forgeline.report(step, loss=loss.item())\n"
)


def plain_script_that_reports(tmp_path: Path) -> Path:
    """examples/byo/plain with `import forgeline` and a report every 10 steps on rank 0."""
    code = tmp_path / "plain-reports"
    shutil.copytree(PLAIN, code, ignore=shutil.ignore_patterns("__pycache__"))
    script = code / "train.py"
    text = script.read_text()
    loop_end = "        step += 1\n"
    assert text.count(loop_end) == 1 and "\nimport torch\n" in text
    text = text.replace("\nimport torch\n", "\nimport forgeline\nimport torch\n", 1)
    script.write_text(text.replace(loop_end, loop_end + REPORTING))
    return code


@pytest.fixture(scope="module")
def reported_run(
    trainer: Trainer, tmp_path_factory: pytest.TempPathFactory
) -> tuple[ProgressTail, Path]:
    """The reporting copy of the plain script run to its end: the tail, the progress file."""
    code = plain_script_that_reports(tmp_path_factory.mktemp("code"))
    spec = plain_spec(steps=60, save_every=40).model_copy(update={"code": str(code)})
    job, folder = plain_job(trainer, "plain-reports", spec=spec)
    job.code_dir = str(code)
    return trainer.run(job, ranks=2, script_folder=folder), Path(job.progress_file)


def test_a_plain_script_s_reports_are_its_run_s_loss(
    reported_run: tuple[ProgressTail, Path],
) -> None:
    tail, progress = reported_run
    assert tail.latest["state"] == "done"
    reported = [line for line in written(progress) if "loss" in line]
    assert [line["step"] for line in reported] == [10, 20, 30, 40, 50, 60]
    printed = (progress.parent / "rank-0.log").read_text()
    assert f"step 60 loss {reported[-1]['loss']:.4f}" in printed  # the script's own loss
    assert tail.latest["loss"] == reported[-1]["loss"]


def test_a_plain_script_s_reports_are_its_run_s_step_and_its_commits_losses(
    trainer: Trainer, reported_run: tuple[ProgressTail, Path]
) -> None:
    """The last commit is at the last reported step, and its manifest carries the reported
    losses: what the run's evaluation reads of a script (trainer.reported_eval)."""
    tail, progress = reported_run
    assert tail.latest["step"] == 60
    last = find_latest(trainer.store, "plain-reports", max_generation=1)
    assert last is not None and last.step == 60
    losses = [(line["step"], line["loss"]) for line in written(progress) if "loss" in line]
    assert last.manifest.loss_history == losses
    judged = reported_evaluation(last.manifest)
    assert judged is not None and (judged.step, judged.measured_on) == (60, "train")


def test_a_script_that_reports_nothing_is_training_once_its_folder_is_committed(
    tmp_path: Path,
) -> None:
    """The node makes its next warm standby once the ranks train (trainer.launch.run_ranks):
    for a script that reports no step, its first commit says so."""
    progress = tmp_path / "progress.jsonl"
    progress.write_text("")
    tail = ProgressTail(progress, start_step=250)
    tail.poll()
    assert not tail.training
    key = "runs/r/checkpoints/step-300/gen-2/MANIFEST.json"
    line = {"time": 1.0, "event": "checkpoint", "step": 300, "manifest_key": key}
    progress.write_text(json.dumps(line) + "\n")
    tail.poll()
    assert tail.training and tail.latest["step"] == 300
