"""A script that keeps its own checkpoints (train.checkpoints = "folder"), after training: the
evaluate activity gives no loss when the script reported none, and register_model makes a
version of the files the spec names from the final commit, at their paths in the folder, on a
real MLflow (SQLite), with lineage that says no loss was reported."""

from __future__ import annotations

import json
import os
from pathlib import Path

import mlflow.tracking._model_registry.utils as registry_utils
import mlflow.tracking._tracking_service.utils as tracking_utils
import mlflow.tracking.fluent as fluent
import pytest
from mlflow.tracking import MlflowClient
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from activities.control import ControlActivities
from infra.settings import Settings
from infra.store.local import LocalStore
from registry.model_files import MODEL_FILES_ARTIFACT
from registry.tracking import EXPERIMENT
from tests.activities.test_eval_source import DATASET
from trainer.folder_checkpoint import CommitTarget
from trainer.folder_watch import FolderWatcher
from trainer.manifest import find_latest
from workflows.approval import gate_passed, measured_loss
from workflows.contracts.models import (
    ApprovalPolicy,
    CheckpointRef,
    EvaluateInput,
    RegisterInput,
)
from workflows.contracts.spec import RunSpec

RUN = "plain"
FILES = {
    "last.pt": b"weights" * 100,
    "config.json": b'{"width": 64}',
    "tokenizer/vocab.txt": b"abc",
    "optimizer.pt": b"moments" * 100,
}


def spec(files: list[str]) -> RunSpec:
    return RunSpec.model_validate({
        "name": RUN, "data": {"sources": ["x"]},
        "train": {"code": "./plain", "entrypoint": "train.py", "checkpoints": "folder"},
        "registry": {"files": files},
    })  # fmt: skip


def keep_mlflow_s_process_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """Registration sets MLflow's process-wide tracking and registry URIs and its experiment
    (registry.tracking), in module state and in the environment: all are put back after the
    test, or a later test's client without URIs of its own would look for its models in this
    test's SQLite file (the CLI's end-to-end test did)."""
    monkeypatch.setattr(registry_utils, "_registry_uri", registry_utils._registry_uri)
    monkeypatch.setattr(tracking_utils, "_tracking_uri", tracking_utils._tracking_uri)
    monkeypatch.setattr(fluent, "_active_experiment_id", fluent._active_experiment_id)
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI", "MLFLOW_EXPERIMENT_ID"):
        monkeypatch.setenv(name, os.environ.get(name, ""))
        if not os.environ[name]:
            monkeypatch.delenv(name)


@pytest.fixture
def control(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ControlActivities:
    """The control worker's activities on a store that holds one folder commit at step 30."""
    keep_mlflow_s_process_state(monkeypatch)
    store = LocalStore(tmp_path / "store")
    folder = tmp_path / "checkpoint"
    for name, data in FILES.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
    target = CommitTarget(RUN, 1, "")
    watcher = FolderWatcher(folder, tmp_path / "staging", store, target, last_step=0)
    poll = watcher.final(30, unchanged_too=True)
    assert poll.commit is not None and poll.commit.step == 30, poll
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    MlflowClient(uri).create_experiment(EXPERIMENT, str(tmp_path / "artifacts"))
    settings = Settings(home=tmp_path / "home", store_url=str(store.root), mlflow_uri=uri)
    return ControlActivities(settings)


def final_ref(control: ControlActivities) -> CheckpointRef:
    found = find_latest(control.store, RUN, max_generation=1)
    assert found is not None
    return CheckpointRef(manifest_key=found.key, step=found.step, generation=1, tokens_seen=0)


def test_a_script_that_reports_nothing_is_evaluated_as_no_loss_and_fails_any_gate(
    control: ControlActivities,
) -> None:
    inp = EvaluateInput(run_id=RUN, spec=spec([]), dataset=DATASET, checkpoint=final_ref(control))
    evaluation = ActivityEnvironment().run(control.evaluate, inp)
    assert (evaluation.val_loss, evaluation.measured_on, evaluation.step) == (None, "nothing", 30)
    assert evaluation.self_reported
    assert not gate_passed(ApprovalPolicy(max_val_loss=5.0), evaluation)
    assert gate_passed(ApprovalPolicy(), evaluation)  # no gate: the approver decides
    assert "reported none" in measured_loss(evaluation)


def register(control: ControlActivities, files: list[str]) -> str:
    run_spec = spec(files)
    checkpoint = final_ref(control)
    evaluation = ActivityEnvironment().run(
        control.evaluate,
        EvaluateInput(run_id=RUN, spec=run_spec, dataset=DATASET, checkpoint=checkpoint),
    )
    inp = RegisterInput(
        run_id=RUN, workflow_run_id=f"wf-{len(files)}", spec=run_spec, spec_sha256="c" * 64,
        dataset=DATASET, checkpoint=checkpoint, evaluation=evaluation,
    )  # fmt: skip
    version = ActivityEnvironment().run(control.register_model, inp)
    return version.version


def test_the_version_holds_the_files_the_spec_names_at_their_paths(
    control: ControlActivities, tmp_path: Path
) -> None:
    version = register(control, ["last.pt", "config.json", "tokenizer/*"])
    client = MlflowClient(tracking_uri=control.settings.mlflow_uri)
    got = client.get_model_version(RUN, version)
    tags = got.tags
    assert tags["forgeline.eval_measured_on"] == "nothing"
    assert "forgeline.val_loss" not in tags and tags["forgeline.servable"] == "false"
    assert tags["forgeline.checkpoint_step"] == "30"
    files = {f.path for f in client.list_artifacts(got.run_id, "model")}
    assert files == {"model/last.pt", "model/config.json", "model/tokenizer"}, files
    folder = Path(client.download_artifacts(got.run_id, "model", str(tmp_path / "down")))
    assert (folder / "tokenizer" / "vocab.txt").read_bytes() == FILES["tokenizer/vocab.txt"]
    assert (folder / "last.pt").read_bytes() == FILES["last.pt"]
    assert not (folder / "optimizer.pt").exists()  # not named: not in the version
    # The record of the version's files names each at its path, with its sha256.
    record_file = client.download_artifacts(got.run_id, MODEL_FILES_ARTIFACT, str(tmp_path))
    record = json.loads(Path(record_file).read_text())
    assert "tokenizer/vocab.txt" in {f["path"] for f in record["files"]}


def test_no_files_named_registers_every_file_and_a_glob_that_matches_none_says_what_is_there(
    control: ControlActivities,
) -> None:
    version = register(control, [])
    client = MlflowClient(tracking_uri=control.settings.mlflow_uri)
    run_id = client.get_model_version(RUN, version).run_id
    files = {f.path for f in client.list_artifacts(run_id, "model")}
    assert {"model/last.pt", "model/optimizer.pt", "model/config.json"} <= files
    # A domain error: the activity fails at once (not retried), with what the commit holds.
    with pytest.raises(
        ApplicationError, match=r"match no file .* holds: config\.json, last\.pt"
    ) as err:
        register(control, ["model.safetensors"])
    assert err.value.non_retryable
