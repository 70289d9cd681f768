"""Dropout on real torchrun ranks (gloo): a run killed and resumed is bitwise the uninterrupted
run under DDP, FSDP and tensor parallelism, since every step's randomness is seeded again from
(seed, step, coordinates) (trainer.rng_streams). With activation recomputation
(trainer.activation_recompute) the recompute draws the forward's masks again: the run is bitwise
the one that kept its activations, and resumes bitwise too."""

from __future__ import annotations

import pytest
import torch

from tests.trainer.conftest import MODEL, Trainer
from tests.trainer.test_distributed_training import killed_and_resumed, weights
from tests.trainer.test_layouts import FSDP, TP
from trainer.manifest import CommittedCheckpoint, find_latest
from workflows.contracts.spec import TrainSpec

DROPOUT = MODEL.model_copy(update={"dropout": 0.1})
TRAIN = TrainSpec(
    steps=30, batch_size=8, learning_rate=3e-3, warmup_steps=5, log_every=5,
    checkpoint_every=10, keep_checkpoints=10, seed=11,
)  # fmt: skip
DDP = {"replicate": 2, "shard": 1, "tensor": 1}
PP = {"replicate": 1, "shard": 1, "tensor": 1, "pipeline": 2, "schedule": "1F1B",
      "stages_per_rank": 1, "microbatches": 4}  # fmt: skip


def _name(layout: dict | None) -> str:
    degrees = [(layout or {}).get(k, 1) for k in ("tensor", "shard", "pipeline")]
    return "dropout-" + "-".join(map(str, degrees))


def clean_run(trainer: Trainer, layout: dict | None) -> CommittedCheckpoint:
    """The uninterrupted run of `layout` that keeps its activations, made once per module."""
    name = f"{_name(layout)}-clean"
    clean = find_latest(trainer.store, name, max_generation=1)
    if clean is None:
        trainer.run(trainer.job(name, TRAIN, layout=layout, model=DROPOUT), ranks=2)
        clean = find_latest(trainer.store, name, max_generation=1)
    assert clean is not None and clean.step == TRAIN.steps
    return clean


def assert_same_run(
    trainer: Trainer, ours: CommittedCheckpoint, clean: CommittedCheckpoint
) -> None:
    assert ours.manifest.loss_history == clean.manifest.loss_history
    mine = weights(trainer, ours.manifest, ours.key.replace("/", "_"))
    for key, tensor in weights(trainer, clean.manifest, clean.key.replace("/", "_")).items():
        assert torch.equal(tensor, mine[key]), key


# FSDP and TP (~20 s each) with the slow tests, to keep make test within 15 minutes: their exact
# resume without dropout stays in it (test_distributed_training.py, test_layouts.py).
@pytest.mark.parametrize(
    "layout",
    [
        None,
        pytest.param(FSDP, marks=pytest.mark.slow),
        pytest.param(TP, marks=pytest.mark.slow),
        pytest.param(PP, marks=pytest.mark.slow),
    ],
    ids=["ddp", "fsdp", "tp", "pp"],
)
def test_a_run_with_dropout_resumes_bitwise(trainer: Trainer, layout: dict | None) -> None:
    clean = clean_run(trainer, layout)
    name = _name(layout)

    def make(**fields: object):
        return trainer.job(name, TRAIN, layout=layout, model=DROPOUT, **fields)

    final = killed_and_resumed(trainer, make, ranks=2)
    assert final.manifest.network["dropout"] == 0.1
    assert_same_run(trainer, final, clean)


# Under tensor parallelism attention dropout draws from each rank's sharded stream, which a
# recompute must replay from where the block's forward found it (rng_streams.ShardedReplay).
# All with the slow tests: make test keeps tests/trainer/test_activation_recompute.py, the same
# bitwise equality in one process.
@pytest.mark.parametrize(
    ("layout", "mode"),
    [
        pytest.param(DDP, "selective", marks=pytest.mark.slow),
        pytest.param(DDP, "full", marks=pytest.mark.slow),
        pytest.param(TP, "full", marks=pytest.mark.slow),
        pytest.param(TP, "selective", marks=pytest.mark.slow),
        pytest.param(FSDP, "full", marks=pytest.mark.slow),
        pytest.param(PP, "selective", marks=pytest.mark.slow),
    ],
    ids=["ddp-selective", "ddp-full", "tp-full", "tp-selective", "fsdp-full", "pp-selective"],
)
def test_recomputed_activations_train_and_resume_bitwise(
    trainer: Trainer, layout: dict, mode: str
) -> None:
    clean = clean_run(trainer, None if layout is DDP else layout)
    recomputed = {**layout, "activation_checkpointing": mode}
    name = f"{_name(layout)}-{mode}"

    def make(**fields: object):
        return trainer.job(name, TRAIN, layout=recomputed, model=DROPOUT, **fields)

    final = killed_and_resumed(trainer, make, ranks=2)
    assert_same_run(trainer, final, clean)
    progress = trainer.root.glob("job-*/progress.jsonl")
    assert any(f'"activation_checkpointing": "{mode}"' in p.read_text() for p in progress)
