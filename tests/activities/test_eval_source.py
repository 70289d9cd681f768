"""Whose eval loss a version records: a user's script reports its own (`run.report_eval`), and
the evaluate activity and the version's lineage say so (`forgeline.eval_source = script`); the
built-in trainer's is measured by Forgeline from the final checkpoint (`platform`)."""

from __future__ import annotations

from pathlib import Path

from temporalio.testing import ActivityEnvironment

from activities.control import ControlActivities, version_lineage
from infra.settings import Settings
from infra.store.local import LocalStore
from trainer.checkpoint_manifest import CheckpointManifest
from trainer.manifest import manifest_key
from workflows.contracts.models import (
    CheckpointRef,
    CodeRef,
    DatasetRef,
    EvalResult,
    EvalSource,
    EvaluateInput,
    RegisterInput,
)
from workflows.contracts.spec import RunSpec

RUN = "byo"
DATASET = DatasetRef(
    snapshot_id="s" * 16, manifest_key="datasets/s/MANIFEST.json", manifest_sha256="a" * 64,
    vocab_size=65, train_tokens=1000, val_tokens=100, documents=10, duplicates_removed=0,
)  # fmt: skip
CODE = CodeRef(
    snapshot_id="c" * 32, manifest_key="code/c/MANIFEST.json", manifest_sha256="b" * 64,
    files=2, bytes=100,
)  # fmt: skip


def spec(entrypoint: str | None) -> RunSpec:
    train = {"code": "./byo", "entrypoint": entrypoint} if entrypoint else {}
    return RunSpec.model_validate({"name": RUN, "data": {"sources": ["x"]}, "train": train})


def script_checkpoint(tmp_path: Path) -> tuple[LocalStore, CheckpointRef]:
    """A committed checkpoint of a user's script that reported a held-out loss at its step."""
    store = LocalStore(tmp_path / "store")
    key = manifest_key(RUN, 20, 1)
    manifest = CheckpointManifest(
        run_id=RUN, step=20, generation=1, files=[], loss_history=[(10, 3.1), (20, 2.9)],
        evaluation={"step": 20, "val_loss": 1.25, "val_tokens": 640},
    )  # fmt: skip
    store.put_bytes(key, manifest.dump_bytes())
    return store, CheckpointRef(manifest_key=key, step=20, generation=1, tokens_seen=0)


def registration(evaluation: EvalResult, checkpoint: CheckpointRef, code: bool) -> RegisterInput:
    return RegisterInput(
        run_id=RUN, workflow_run_id="wf", spec=spec("train.py" if code else None),
        spec_sha256="c" * 64, dataset=DATASET, checkpoint=checkpoint, evaluation=evaluation,
        code=CODE if code else None,
    )  # fmt: skip


def test_a_script_s_eval_is_tagged_self_reported_and_the_platform_s_is_not(
    tmp_path: Path,
) -> None:
    store, checkpoint = script_checkpoint(tmp_path)
    control = ControlActivities(Settings(home=tmp_path / "home", store_url=str(store.root)))
    inp = EvaluateInput(run_id=RUN, spec=spec("train.py"), dataset=DATASET, checkpoint=checkpoint)
    reported = ActivityEnvironment().run(control.evaluate, inp)
    assert (reported.val_loss, reported.measured_on) == (1.25, "held-out")
    assert reported.source == EvalSource.SCRIPT and reported.self_reported

    tags = version_lineage(registration(reported, checkpoint, True), "wf-id", [], True).dump()
    assert tags["forgeline.eval_source"] == "script"

    measured = EvalResult(
        step=20, val_loss=1.3, perplexity=3.7, val_tokens=640, sample="",
        source=EvalSource.PLATFORM,
    )  # fmt: skip
    tags = version_lineage(registration(measured, checkpoint, False), "wf-id", [], True).dump()
    assert tags["forgeline.eval_source"] == "platform"
    # An evaluation from a run in flight when the source began to be recorded: a user's code
    # run's eval was always its script's.
    older = reported.model_copy(update={"source": None})
    tags = version_lineage(registration(older, checkpoint, True), "wf-id", [], True).dump()
    assert tags["forgeline.eval_source"] == "script"
