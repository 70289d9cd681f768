"""Pipeline parallelism on real torchrun ranks (gloo): the built-in GPT split into stages
trains the curve of data parallelism at the same global batch under each schedule, composes
with sharding and tensor parallelism, checkpoints per stage under the whole model's names,
resumes bitwise on the same degrees and on other degrees of pipeline and data parallelism."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.trainer.conftest import MODEL, Trainer
from tests.trainer.test_distributed_training import killed_and_resumed, weights
from trainer.attempt_clock import read_ledger
from trainer.checkpoint import fetch_checkpoint
from trainer.checkpoint_manifest import CheckpointManifest
from trainer.data import TokenStream
from trainer.errors import RanksFailed
from trainer.evaluate import held_out_loss
from trainer.job import TrainJob
from trainer.manifest import find_latest
from trainer.model import GPT, GPTConfig
from trainer.pipeline import PipelineSettings
from workflows.contracts.spec import TrainSpec

DEEP = MODEL.model_copy(update={"n_layer": 4})
TRAIN = TrainSpec(
    steps=30, batch_size=8, learning_rate=3e-3, warmup_steps=5, log_every=5,
    checkpoint_every=10, keep_checkpoints=10, seed=7, eval_every=30, eval_batches=3,
)  # fmt: skip
DDP2 = {"replicate": 2, "shard": 1, "tensor": 1}


def pipelined(
    stages: int = 2, schedule: str = "1F1B", per_rank: int = 1, microbatches: int = 4, **degrees
) -> dict:
    pipeline = {"pipeline": stages, "schedule": schedule, "stages_per_rank": per_rank,
                "microbatches": microbatches}  # fmt: skip
    return {"replicate": 1, "shard": 1, "tensor": 1, **degrees, **pipeline}


def job(trainer: Trainer, run: str, layout: dict, **fields: object) -> TrainJob:
    """A job of the deeper GPT that scores the held-out split at its end."""
    return trainer.job(run, TRAIN, layout=layout, model=DEEP, val_shards=val_shards(trainer),
                       **fields)  # fmt: skip


def val_shards(trainer: Trainer) -> list[str]:
    return [str(trainer.store.root / s.key) for s in trainer.snapshot.manifest.splits["val"].shards]


def finished(trainer: Trainer, run: str, generation: int = 1) -> CheckpointManifest:
    found = find_latest(trainer.store, run, max_generation=generation)
    assert found is not None and found.step == TRAIN.steps, run
    return found.manifest


@pytest.fixture(scope="module")
def data_parallel(trainer: Trainer) -> CheckpointManifest:
    """The same model and global batch under DDP on two ranks."""
    trainer.run(job(trainer, "pp-ddp", DDP2), ranks=2)
    return finished(trainer, "pp-ddp")


def close_curves(ours: CheckpointManifest, theirs: CheckpointManifest, abs_: float) -> None:
    assert [s for s, _ in ours.loss_history] == [s for s, _ in theirs.loss_history]
    for (step, a), (_, b) in zip(ours.loss_history, theirs.loss_history, strict=True):
        assert a == pytest.approx(b, abs=abs_), step


@pytest.mark.parametrize(
    "layout",
    [
        pipelined(),
        pytest.param(pipelined(schedule="interleaved-1F1B", per_rank=2), marks=pytest.mark.slow),
        pytest.param(pipelined(schedule="zero-bubble", per_rank=2), marks=pytest.mark.slow),
    ],
    ids=["1F1B", "interleaved-1F1B", "zero-bubble"],
)
def test_two_stages_train_the_curve_of_data_parallelism(
    trainer: Trainer, data_parallel: CheckpointManifest, layout: dict
) -> None:
    run = f"pp-{layout['schedule']}"
    trainer.run(job(trainer, run, layout), ranks=2)
    ours = finished(trainer, run)
    assert ours.layout["pipeline"] == 2 and ours.layout["strategy"] == "pp"
    # The same mean gradient, added up in another order (micro-batches, a pipeline).
    close_curves(ours, data_parallel, 1e-4)
    # Its bubble is booked as its own cause: the schedule's share of the working time.
    totals = read_ledger(trainer.store, run, 1).last.totals
    share = PipelineSettings.from_layout(layout).bubble()
    working = totals.train_s - totals.straggler_s - totals.shadow_s
    assert totals.bubble_s == pytest.approx(share * working, rel=1e-6) and totals.bubble_s > 0
    mine = weights(trainer, ours, run)
    # Scored through the stages in order: the whole model's held-out loss, as one process
    # scores the same weights on the same batches.
    whole = GPT(GPTConfig(**ours.network))
    whole.load_state_dict(mine)
    stream = TokenStream([Path(p) for p in val_shards(trainer)], trainer.snapshot.manifest.dtype,
                         DEEP.block_size)  # fmt: skip
    loss, tokens = held_out_loss(whole.eval(), stream, TRAIN.batch_size, TRAIN.eval_batches)
    assert ours.evaluation["val_tokens"] == tokens
    assert ours.evaluation["val_loss"] == pytest.approx(loss, abs=1e-5)
    for name, tensor in weights(trainer, data_parallel, f"{run}-ddp").items():
        assert torch.allclose(tensor, mine[name], atol=1e-4), name


@pytest.mark.parametrize(
    ("layout", "ranks"),
    [
        pytest.param(pipelined(stages=2, shard=2), 4, marks=pytest.mark.slow),
        pytest.param(pipelined(stages=2, replicate=2), 4, marks=pytest.mark.slow),
        pytest.param(pipelined(stages=4), 4, marks=pytest.mark.slow),
        pytest.param(pipelined(stages=2, tensor=2), 4, marks=pytest.mark.slow),
        pytest.param(pipelined(stages=2, shard=2, tensor=2), 8, marks=pytest.mark.slow),
    ],
    ids=["pp2-fsdp2", "pp2-ddp2", "pp4", "pp2-tp2", "pp2-fsdp2-tp2"],
)
def test_a_pipeline_composes_with_sharding_and_tensor_parallelism(
    trainer: Trainer, data_parallel: CheckpointManifest, layout: dict, ranks: int
) -> None:
    degrees = [layout[k] for k in ("pipeline", "replicate", "shard", "tensor")]
    run = "pp-" + "-".join(map(str, degrees))
    trainer.run(job(trainer, run, layout), ranks=ranks)
    ours = finished(trainer, run)
    assert ours.world_size == ranks and ours.layout["pipeline"] == layout["pipeline"]
    close_curves(ours, data_parallel, 1e-4)


# With the slow tests (with the other layouts' and the staged script's), to keep make test
# within 15 minutes: the curve against DDP above stays in it.
@pytest.mark.slow
def test_a_pipeline_resumes_bitwise_after_a_kill(trainer: Trainer) -> None:
    layout = pipelined()
    trainer.run(job(trainer, "pp-clean", layout), ranks=2)
    clean = finished(trainer, "pp-clean")

    def make(**fields: object):
        return job(trainer, "pp-killed", layout, **fields)

    final = killed_and_resumed(trainer, make, ranks=2)
    assert final.manifest.loss_history == clean.loss_history
    mine = weights(trainer, final.manifest, "pp-killed")
    for name, tensor in weights(trainer, clean, "pp-clean").items():
        assert torch.equal(tensor, mine[name]), name


@pytest.mark.parametrize(
    ("before", "after"),
    [
        pytest.param(pipelined(), DDP2, marks=pytest.mark.slow),
        pytest.param(DDP2, pipelined(), marks=pytest.mark.slow),
    ],
    ids=["2-stages-to-2-replicas", "2-replicas-to-2-stages"],
)
def test_a_checkpoint_resumes_on_other_degrees(
    trainer: Trainer, data_parallel: CheckpointManifest, before: dict, after: dict
) -> None:
    """The stages' shards hold the whole model's names: a pipeline's checkpoint loads into
    replicas and the other way, and the run goes on along the same curve, global batch kept."""
    run = f"pp-moved-{before.get('pipeline', 1)}"

    def make(generation: int = 1, **fields: object):
        layout = before if generation == 1 else after
        return job(trainer, run, layout, generation=generation, **fields)

    moved = killed_and_resumed(trainer, make, ranks=2).manifest
    assert moved.layout.get("pipeline", 1) == after.get("pipeline", 1)
    close_curves(moved, data_parallel, 1e-4)


@pytest.mark.slow
def test_a_pipeline_fine_tunes_from_a_whole_model_s_checkpoint(
    trainer: Trainer, data_parallel: CheckpointManifest
) -> None:
    """Fine-tuning builds the whole model, loads the weights, then keeps this rank's stages."""
    found = find_latest(trainer.store, "pp-ddp", max_generation=1)
    assert found is not None
    folder = fetch_checkpoint(trainer.store, found.manifest, trainer.root / "fetched" / "pp-init")
    short = TRAIN.model_copy(update={"steps": 5, "warmup_steps": 1, "learning_rate": 1e-4,
                                     "log_every": 1, "eval_every": 0})  # fmt: skip
    job = trainer.job("pp-tuned", short, layout=pipelined(), model=DEEP, init_weights=str(folder))
    trainer.run(job, ranks=2)
    tuned = find_latest(trainer.store, "pp-tuned", max_generation=1)
    assert tuned is not None and tuned.step == 5
    scratch_first, trained_last = (
        data_parallel.loss_history[0][1],
        data_parallel.loss_history[-1][1],
    )
    # It starts where the whole model's run ended, far below where training from scratch starts.
    assert tuned.manifest.loss_history[0][1] < trained_last + 0.2 < scratch_first - 0.3


@pytest.mark.slow
def test_a_stage_s_non_finite_gradients_stop_the_gang_and_name_its_rank(trainer: Trainer) -> None:
    """NaN gradients on rank 0 (stage 0) at step 15: the gang stops before anything of that step
    is saved, and the verdict names the rank whose own gradients went bad."""
    corrupt = job(trainer, "pp-corrupt", pipelined())
    corrupt.chaos_file = str(Path(corrupt.progress_file).parent / "CORRUPT_GRAD")
    Path(corrupt.chaos_file).parent.mkdir(parents=True, exist_ok=True)
    Path(corrupt.chaos_file).write_text("corrupt-grad 15\n")
    with pytest.raises(RanksFailed, match=r"non-finite loss or gradients at step 15"):
        trainer.run(corrupt, ranks=2)
    progress = Path(corrupt.progress_file).read_text().splitlines()
    events = [json.loads(line) for line in progress]
    (health,) = [e for e in events if e["event"] == "health"]
    assert (health["kind"], health["rank"], health["step"]) == ("corruption", 0, 15)
    found = find_latest(trainer.store, "pp-corrupt", max_generation=1)
    assert found is not None and found.step == 10
