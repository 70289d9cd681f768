"""The evaluate activity on a real run's checkpoints: the final one gives the model's figures,
the older ones still kept give the val-loss curve, and one of those that no longer verifies is
left out of the curve with a note instead of failing a finished run."""

from __future__ import annotations

from pathlib import Path

from temporalio.testing import ActivityEnvironment

from activities.control import ControlActivities, _reference
from activities.data_stages import dataset_ref
from infra.settings import Settings
from tests.trainer.conftest import Trainer
from tests.trainer.test_layouts import TRAIN
from trainer.manifest import find_latest, manifest_key, read_manifest
from workflows.contracts.models import EvalSource, EvaluateInput
from workflows.contracts.spec import RunSpec


def test_an_older_checkpoint_that_does_not_verify_is_left_out_of_the_curve(
    trainer: Trainer,
    tmp_path: Path,
) -> None:
    train = TRAIN.model_copy(update={"steps": 30, "checkpoint_every": 10, "keep_checkpoints": 3})
    trainer.run(trainer.job("curve", train), ranks=1)
    store = trainer.store
    rotten = read_manifest(store, manifest_key("curve", 10, 1)).files[0].key
    store.put_bytes(rotten, b"bit rot")
    latest = find_latest(store, "curve", max_generation=1)
    assert latest is not None and latest.step == 30
    spec = RunSpec.model_validate({
        "name": "curve", "data": {"sources": ["corpus.txt"]},
        "train": {"batch_size": 8, "eval_batches": 2},
    })  # fmt: skip
    control = ControlActivities(Settings(home=tmp_path, store_url=str(store.root)))
    inp = EvaluateInput(
        run_id="curve",
        spec=spec,
        dataset=dataset_ref(trainer.snapshot),
        checkpoint=_reference(latest),
    )
    evaluation = ActivityEnvironment().run(control.evaluate, inp)
    assert evaluation.step == 30 and evaluation.val_loss > 0
    assert evaluation.source == EvalSource.PLATFORM  # measured here, not reported by the run
    assert [point.step for point in evaluation.curve] == [20, 30]
    (note,) = evaluation.curve_left_out
    assert note.startswith("step 10: ") and "corrupt" in note, note
