"""Dropout on real torchrun ranks (gloo): a run killed and resumed is bitwise the uninterrupted
run under DDP, FSDP and tensor parallelism, since every step's randomness is seeded again from
(seed, step, coordinates) (trainer.rng_streams)."""

from __future__ import annotations

import pytest
import torch

from tests.trainer.conftest import MODEL, Trainer
from tests.trainer.test_distributed_training import killed_and_resumed, weights
from tests.trainer.test_layouts import FSDP, TP
from trainer.manifest import find_latest
from workflows.contracts.spec import TrainSpec

DROPOUT = MODEL.model_copy(update={"dropout": 0.1})
TRAIN = TrainSpec(
    steps=30, batch_size=8, learning_rate=3e-3, warmup_steps=5, log_every=5,
    checkpoint_every=10, keep_checkpoints=10, seed=11,
)  # fmt: skip


# FSDP and TP (~20 s each) with the slow tests, to keep make test within 15 minutes: their exact
# resume without dropout stays in it (test_distributed_training.py, test_layouts.py).
@pytest.mark.parametrize(
    "layout",
    [None, pytest.param(FSDP, marks=pytest.mark.slow), pytest.param(TP, marks=pytest.mark.slow)],
    ids=["ddp", "fsdp", "tp"],
)
def test_a_run_with_dropout_resumes_bitwise(trainer: Trainer, layout: dict | None) -> None:
    name = f"dropout-{(layout or {}).get('tensor', 1)}-{(layout or {}).get('shard', 1)}"
    trainer.run(trainer.job(f"{name}-clean", TRAIN, layout=layout, model=DROPOUT), ranks=2)
    clean = find_latest(trainer.store, f"{name}-clean", max_generation=1)
    assert clean is not None and clean.step == TRAIN.steps

    def make(**fields: object):
        return trainer.job(name, TRAIN, layout=layout, model=DROPOUT, **fields)

    final = killed_and_resumed(trainer, make, ranks=2)
    assert final.manifest.network["dropout"] == 0.1
    assert final.manifest.loss_history == clean.manifest.loss_history
    ours = weights(trainer, final.manifest, f"{name}-final")
    for key, tensor in weights(trainer, clean.manifest, f"{name}-clean").items():
        assert torch.equal(tensor, ours[key]), key
