"""A user's own rank script through the SDK, in real torchrun ranks: it trains, resumes exactly
after a SIGKILL, and a script that cannot start fails as the user's error, with its line."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import shutil
import signal
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO
from tests.trainer.conftest import Trainer
from tests.trainer.test_distributed_training import job_processes, resume_point
from trainer.checkpoint import fetch_checkpoint, load_model_weights
from trainer.errors import RanksFailed, UserCodeFailed
from trainer.job import TrainJob
from trainer.manifest import find_latest, manifest_key
from workflows.spec import TrainSpec

GRU = REPO / "examples" / "byo" / "gru"
ARGS = {"block": 32, "width": 32, "layers": 1}


def user_train(code: Path, entrypoint: str = "train.py", **train: object) -> TrainSpec:
    settings = {"steps": 40, "batch_size": 8, "learning_rate": 3e-3, "log_every": 5,
                "checkpoint_every": 10, "keep_checkpoints": 10, "eval_every": 20,
                "eval_batches": 4, "seed": 5, **train}  # fmt: skip
    return TrainSpec(code=str(code), entrypoint=entrypoint, args=ARGS, **settings)


def user_job(trainer: Trainer, run_id: str, code: Path, train: TrainSpec, **fields) -> TrainJob:
    val = [
        str(trainer.store.root / s["key"])
        for s in trainer.snapshot.manifest["splits"]["val"]["shards"]
    ]
    return trainer.job(run_id, train, code_dir=str(code), val_shards=val, **fields)


def gru_weights(trainer: Trainer, manifest: dict, tag: str) -> dict[str, torch.Tensor]:
    spec = importlib.util.spec_from_file_location("byo_gru", GRU / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    vocab = trainer.snapshot.manifest["tokenizer"]["vocab_size"]
    model = module.CharGRU(vocab, ARGS["width"], ARGS["layers"])
    load_model_weights(model, fetch_checkpoint(trainer.store, manifest, trainer.root / tag))
    return model.state_dict()


def test_a_user_script_resumes_exactly_after_a_sigkill(trainer: Trainer) -> None:
    train = user_train(GRU)
    trainer.run(user_job(trainer, "gru-ref", GRU, train), ranks=2)
    reference = find_latest(trainer.store, "gru-ref", max_generation=1)
    assert reference is not None and reference.step == 40
    assert reference.manifest["evaluation"]["step"] == 40  # the script's own held-out loss
    assert reference.manifest["evaluation"]["val_loss"] < reference.manifest["loss_history"][0][1]

    job = user_job(trainer, "gru-killed", GRU, train)

    async def kill_after_first_commit() -> None:
        task = await trainer.start_until_committed(job, ranks=2)
        for pid in job_processes(Path(job.progress_file).parent / "job.json", launcher=True):
            os.kill(pid, signal.SIGKILL)
        with pytest.raises(RanksFailed):
            await task

    asyncio.run(kill_after_first_commit())
    found = find_latest(trainer.store, "gru-killed", max_generation=1)
    assert found is not None and found.step < 40
    resume = resume_point(
        trainer, found.manifest, "gru-killed", manifest_key("gru-killed", found.step)
    )
    trainer.run(user_job(trainer, "gru-killed", GRU, train, resume=resume, generation=2), ranks=2)
    final = find_latest(trainer.store, "gru-killed", max_generation=2)
    assert final is not None and final.step == 40
    assert final.manifest["loss_history"] == reference.manifest["loss_history"]
    ours, theirs = (
        gru_weights(trainer, final.manifest, "a"),
        gru_weights(trainer, reference.manifest, "b"),
    )
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)


def broken_script(tmp_path: Path, name: str, text: str) -> Path:
    code = tmp_path / name
    code.mkdir()
    shutil.copy(GRU / "train.py", code / "train.py")
    (code / "train.py").write_text(text.replace("<GRU>", (GRU / "train.py").read_text()))
    return code


@pytest.mark.parametrize(
    ("name", "text", "said"),
    [
        ("typo", "import forgeline\nrun = forgeline.init()\nmodle.train()\n",
         r"before its first step: NameError: name 'modle' is not defined \(train\.py, line 3\)"),
        ("missing", "import forgeline\nimport surely_not_installed_anywhere\n",
         r"ModuleNotFoundError: No module named 'surely_not_install\w+' \(train\.py, line 2\)"),
        ("syntax", "def main(:\n    pass\n", r"SyntaxError: .*\(train\.py, line 1\)"),
        ("idle", "import forgeline\nrun = forgeline.init()\nrun.finish()\n",
         r"returned without training: it must call run\.steps\(\)"),
    ],
)  # fmt: skip
def test_a_script_that_cannot_start_is_the_users_error(
    trainer: Trainer, tmp_path: Path, name: str, text: str, said: str
) -> None:
    code = broken_script(tmp_path, name, text)
    with pytest.raises(UserCodeFailed, match=said):
        trainer.run(user_job(trainer, f"broken-{name}", code, user_train(code)), ranks=2)


def test_a_crash_after_training_began_is_a_crash(trainer: Trainer, tmp_path: Path) -> None:
    """Restarted from the last checkpoint like a dead node, not failed as a mistake."""
    text = (
        (GRU / "train.py")
        .read_text()
        .replace(
            "        step.gradients(model)\n",
            "        step.gradients(model)\n        if step.number == 12:\n"
            "            raise RuntimeError('out of memory at step 12')\n",
        )
    )
    code = broken_script(tmp_path, "late", text)
    with pytest.raises(RanksFailed) as failed:
        trainer.run(user_job(trainer, "late-crash", code, user_train(code)), ranks=2)
    assert not isinstance(failed.value, UserCodeFailed)
    assert find_latest(trainer.store, "late-crash", max_generation=1).step == 10
