"""A user's own model split into pipeline stages through the SDK (examples/byo/staged): it
trains, resumes bitwise after a kill, keeps the whole model's parameter names (its weights
load into the script's `LM`), and resumes on another pipeline degree."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.conftest import REPO
from tests.trainer.conftest import Trainer
from tests.trainer.test_distributed_training import killed_and_resumed
from tests.trainer.test_user_code import user_job, user_train, vocab
from trainer.checkpoint import fetch_checkpoint, load_model_weights
from trainer.checkpoint_manifest import CheckpointManifest
from trainer.manifest import find_latest

STAGED = REPO / "examples" / "byo" / "staged"
ARGS = {"block": 32, "width": 32, "layers": 4, "kernel": 4}


def layout(stages: int, replicate: int = 1) -> dict:
    return {"replicate": replicate, "shard": 1, "tensor": 1, "pipeline": stages,
            "schedule": "1F1B", "stages_per_rank": 1, "microbatches": 4}  # fmt: skip


def whole_weights(trainer: Trainer, manifest: CheckpointManifest, tag: str) -> dict:
    """The checkpoint loaded into the script's whole model, by its parameter names."""
    spec = importlib.util.spec_from_file_location("byo_staged", STAGED / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = module.LM(vocab(trainer), ARGS["width"], ARGS["layers"], ARGS["kernel"])
    load_model_weights(model, fetch_checkpoint(trainer.store, manifest, trainer.root / tag))
    return model.state_dict()


@pytest.fixture(scope="module")
def staged_reference(trainer: Trainer) -> CheckpointManifest:
    job = user_job(trainer, "staged-ref", STAGED, user_train(STAGED, args=ARGS), layout=layout(2))
    trainer.run(job, ranks=2)
    found = find_latest(trainer.store, "staged-ref", max_generation=1)
    assert found is not None and found.step == 40
    assert found.manifest.layout["pipeline"] == 2
    losses = [loss for _, loss in found.manifest.loss_history]
    assert losses[-1] < losses[0] - 0.5  # it learns
    return found.manifest


@pytest.mark.slow  # with test_pipeline's resumes: make test keeps its curve against DDP
def test_a_staged_script_resumes_bitwise(
    trainer: Trainer, staged_reference: CheckpointManifest
) -> None:
    def make(**fields: object):
        train = user_train(STAGED, args=ARGS)
        return user_job(trainer, "staged-killed", STAGED, train, layout=layout(2), **fields)

    final = killed_and_resumed(trainer, make, ranks=2).manifest
    assert final.loss_history == staged_reference.loss_history
    ours = whole_weights(trainer, final, "staged-a")
    theirs = whole_weights(trainer, staged_reference, "staged-b")
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)


@pytest.mark.slow
def test_a_staged_script_resumes_on_one_stage_of_two_replicas(
    trainer: Trainer, staged_reference: CheckpointManifest
) -> None:
    def make(generation: int = 1, **fields: object):
        train = user_train(STAGED, args=ARGS)
        degrees = layout(2) if generation == 1 else layout(1, replicate=2)
        return user_job(trainer, "staged-moved", STAGED, train, layout=degrees,
                        generation=generation, **fields)  # fmt: skip

    final = killed_and_resumed(trainer, make, ranks=2).manifest
    assert final.layout.get("pipeline", 1) == 1
    for (step, ours), (_, theirs) in zip(final.loss_history, staged_reference.loss_history,
                                         strict=True):  # fmt: skip
        assert ours == pytest.approx(theirs, abs=1e-4), step
