"""Registration against a real MLflow tracking store (SQLite), as the registry activity does it."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime
from pathlib import Path

import mlflow
import pytest
import torch
from mlflow.tracking import MlflowClient

from dataprep.tokenizer import char_tokenizer
from registry.errors import ModelOfAnotherTeam, VersionNotFound
from registry.fine_tune_sources import readable_checkpoint
from registry.names import DECISION_TAG, TEAM_TAG
from registry.tracking import (
    CANDIDATE,
    CHECKPOINT_TAG,
    EXPERIMENT,
    PRODUCTION,
    DatasetUsed,
    Registration,
    checkpoint_of,
    close_run,
    flatten,
    model_team,
    open_run,
    record_decision,
    register,
)
from trainer.model import GPT, GPTConfig
from trainer.serving import export_model, served_code


@pytest.fixture(scope="module")
def tracking_uri(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = tmp_path_factory.mktemp("mlflow")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    # Created first so the runs' artifacts land under tmp, not in ./mlruns of the working folder.
    MlflowClient(uri).create_experiment(EXPERIMENT, str(root / "artifacts"))
    return uri


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("export")
    text = "To be, or not to be, that is the question."
    tokenizer = char_tokenizer([text])
    tokenizer.save(str(root / "tokenizer.json"))
    torch.manual_seed(0)
    model = GPT(
        GPTConfig(
            vocab_size=tokenizer.get_vocab_size(), n_layer=1, n_head=1, n_embd=16, block_size=16
        )
    )
    return export_model(model, root / "tokenizer.json", root / "model")


def registration(artifacts: dict[str, str], key: str) -> Registration:
    """As activities/control.py's register_model registers (served_code), with made-up lineage."""
    served = served_code()
    return Registration(
        model_name="tiny-lm",
        run_name="tiny",
        params={"train": {"steps": 10, "batch_size": 4}},
        metrics={"val_loss": 2.5},
        metric_series={"train_loss": [(5, 3.0), (10, 2.6)]},
        run_tags={"forgeline.run": "tiny"},
        version_tags={
            "forgeline.dataset_snapshot": "abc123",
            "forgeline.git_commit": "deadbeef",
            CHECKPOINT_TAG: f"runs/{key}/checkpoints/step-10/MANIFEST.json",
        },
        artifacts=artifacts,
        python_model=served.entry,
        code_modules=served.modules,
        signature=served.signature,
        pip_requirements=served.pip_requirements,
        idempotency_key=key,
        texts={"sample.txt": "To be"},
    )


def test_register_is_idempotent_and_sets_candidate(
    tracking_uri: str, artifacts: dict[str, str]
) -> None:
    first = register(tracking_uri, registration(artifacts, "wf-run-1"))
    again = register(tracking_uri, registration(artifacts, "wf-run-1"))
    assert again == first
    client = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
    version = client.get_model_version_by_alias("tiny-lm", CANDIDATE)
    assert version.version == first.version
    assert version.tags["forgeline.dataset_snapshot"] == "abc123"
    run = client.get_run(first.mlflow_run_id)
    assert run.data.params["train.steps"] == "10"
    assert [m.value for m in client.get_metric_history(first.mlflow_run_id, "train_loss")] == [
        3.0,
        2.6,
    ]

    second = register(tracking_uri, registration(artifacts, "wf-run-2"))
    assert int(second.version) == int(first.version) + 1


def test_decision_moves_production_and_is_recorded(
    tracking_uri: str, artifacts: dict[str, str]
) -> None:
    registered = register(tracking_uri, registration(artifacts, "wf-run-3"))
    when = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
    record_decision(
        tracking_uri,
        "tiny-lm",
        registered.version,
        approver="bob",
        approve=True,
        reason="ok",
        decided_at=when,
    )
    client = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
    production = client.get_model_version_by_alias("tiny-lm", PRODUCTION)
    assert production.version == registered.version
    assert production.tags["forgeline.decided_by"] == "bob"
    assert production.tags["forgeline.decided_at"] == when.isoformat()

    rejected = register(tracking_uri, registration(artifacts, "wf-run-4"))
    record_decision(
        tracking_uri,
        "tiny-lm",
        rejected.version,
        approver="carol",
        approve=False,
        reason="too high",
        decided_at=when,
    )
    assert client.get_model_version_by_alias("tiny-lm", PRODUCTION).version == registered.version
    assert (
        client.get_model_version("tiny-lm", rejected.version).tags["forgeline.decision"]
        == "rejected"
    )
    with pytest.raises(VersionNotFound):
        record_decision(
            tracking_uri, "tiny-lm", "999", approver="bob", approve=True, reason="", decided_at=when
        )


def test_registered_model_generates_text(tracking_uri: str, artifacts: dict[str, str]) -> None:
    registered = register(tracking_uri, registration(artifacts, "wf-run-5"))
    mlflow.set_tracking_uri(tracking_uri)
    model = mlflow.pyfunc.load_model(f"models:/tiny-lm/{registered.version}")
    (text,) = model.predict(["To be"], params={"max_new_tokens": 12, "seed": 1})
    continuation = model.predict(["To be"], params={"max_new_tokens": 12, "seed": 1})[0]
    assert text == continuation  # seeded: the same request gives the same text
    assert text.startswith("To be") and len(text) > len("To be")


def test_flatten() -> None:
    assert flatten({"a": {"b": 1, "c": {"d": "x"}}, "e": [1, 2]}) == {
        "a.b": "1",
        "a.c.d": "x",
        "e": "[1, 2]",
    }


def test_export_round_trip(artifacts: dict[str, str]) -> None:
    assert Path(artifacts["weights"]).stat().st_size > 0


def test_a_registered_version_leads_back_to_its_checkpoint(
    tracking_uri: str, artifacts: dict[str, str]
) -> None:
    """What `model.init_from = "models:/NAME@ALIAS"` follows to start fine-tuning."""
    registered = register(tracking_uri, registration(artifacts, "wf-run-ft"))
    expected = (registered.version, "runs/wf-run-ft/checkpoints/step-10/MANIFEST.json")
    assert checkpoint_of(tracking_uri, f"models:/tiny-lm/{registered.version}") == expected
    client = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
    client.set_registered_model_alias("tiny-lm", "base", registered.version)
    assert checkpoint_of(tracking_uri, "models:/tiny-lm@base") == expected
    with pytest.raises(VersionNotFound, match="models:/tiny-lm/999 is not in the registry"):
        checkpoint_of(tracking_uri, "models:/tiny-lm/999")
    with pytest.raises(VersionNotFound, match="check the name"):
        checkpoint_of(tracking_uri, "models:/no-such-model@production")


def test_the_run_opened_at_the_start_receives_the_model_and_its_dataset(
    tracking_uri: str, artifacts: dict[str, str]
) -> None:
    """Training opens the MLflow run (metrics stream into it); registration logs into the same
    run, with the dataset snapshot as its input. Opening again finds the same run."""
    opened = open_run(tracking_uri, "tiny", "wf-run-6", {"train": {"steps": 10}}, {"a": "b"})
    assert open_run(tracking_uri, "tiny", "wf-run-6", {"train": {"steps": 10}}, {}) == opened
    reg = registration(artifacts, "wf-run-6")
    reg.mlflow_run_id = opened
    reg.dataset = DatasetUsed(
        name="snapshot-abc123",
        uri="file:///tmp/store/datasets/abc123/MANIFEST.json",
        digest="f" * 64,
        tags={"snapshot": "abc123"},
    )
    registered = register(tracking_uri, reg)
    assert registered.mlflow_run_id == opened
    client = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
    (used,) = client.get_run(opened).inputs.dataset_inputs
    assert used.dataset.name == "snapshot-abc123" and used.dataset.digest == "f" * 32


def test_a_run_that_ends_without_a_model_ends_its_mlflow_run(tracking_uri: str) -> None:
    opened = open_run(tracking_uri, "doomed", "wf-run-9", {"train": {"steps": 10}}, {})
    client = MlflowClient(tracking_uri=tracking_uri)
    assert client.get_run(opened).info.status == "RUNNING"
    close_run(tracking_uri, opened, "FAILED", "node n1 died 6 times: max_restarts reached")
    close_run(tracking_uri, opened, "FAILED", "node n1 died 6 times: max_restarts reached")
    run = client.get_run(opened)
    assert run.info.status == "FAILED" and run.info.end_time is not None
    assert run.data.tags["forgeline.error"].startswith("node n1 died")


def test_an_expired_window_is_recorded_and_moves_no_alias(
    tracking_uri: str, artifacts: dict[str, str]
) -> None:
    client = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
    before = client.get_registered_model("tiny-lm").aliases.get(PRODUCTION)
    late = register(tracking_uri, registration(artifacts, "wf-run-7"))
    when = datetime(2026, 11, 30, tzinfo=UTC)
    record_decision(
        tracking_uri,
        "tiny-lm",
        late.version,
        approver="forgeline",
        approve=False,
        reason="nobody decided within 7 days",
        decided_at=when,
        expired=True,
        extra_tags={"forgeline.gate": "none"},
    )
    tags = client.get_model_version("tiny-lm", late.version).tags
    assert tags["forgeline.decision"] == "expired" and tags["forgeline.gate"] == "none"
    assert client.get_registered_model("tiny-lm").aliases.get(PRODUCTION) == before


def test_a_model_belongs_to_the_team_that_registered_it_first(
    tracking_uri: str, artifacts: dict[str, str]
) -> None:
    client = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
    mine = dataclasses.replace(registration(artifacts, "wf-team-1"), model_name="owned", team="nlp")
    first = register(tracking_uri, mine)
    assert model_team(client, "owned") == "nlp"
    theirs = dataclasses.replace(mine, idempotency_key="wf-team-2", team="vision")
    with pytest.raises(ModelOfAnotherTeam, match=r"belongs to team 'nlp'.*registry\.model_name"):
        register(tracking_uri, theirs)
    # Nothing of the refused run reached the model: no version, no alias moved.
    versions = client.search_model_versions("name = 'owned'")
    assert [v.version for v in versions] == [first.version]
    assert client.get_model_version_by_alias("owned", "candidate").version == first.version
    again = register(tracking_uri, dataclasses.replace(mine, idempotency_key="wf-team-3"))
    assert again.version != first.version  # the owning team goes on adding versions
    # A model from before teams is claimed by the first team that registers it now.
    client.create_registered_model("older")
    register(tracking_uri, dataclasses.replace(mine, model_name="older", idempotency_key="t4"))
    assert model_team(client, "older") == "nlp"


# Which registered versions a team may fine-tune from (registry.fine_tune_sources): its own
# team's models at any version, another team's only at an approved version.


def _team_version(client: MlflowClient, model: str, run: str, decision: str | None = None) -> str:
    tags = {CHECKPOINT_TAG: f"runs/{run}/checkpoints/step-10/gen-1/MANIFEST.json"}
    if decision is not None:
        tags[DECISION_TAG] = decision
    return str(client.create_model_version(model, f"file:///nowhere/{run}", tags=tags).version)


@pytest.fixture(scope="module")
def registry(tracking_uri: str) -> str:
    """Team a's model `a-lm` (version 1 undecided), team b's `b-lm` (version 1 approved, 2 its
    candidate, undecided), and `old-lm`, registered before models had teams (1 rejected), in
    the module's registry."""
    uri = tracking_uri
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    client.create_registered_model("a-lm", tags={TEAM_TAG: "a"})
    client.create_registered_model("b-lm", tags={TEAM_TAG: "b"})
    client.create_registered_model("old-lm")
    _team_version(client, "a-lm", "a-run")
    _team_version(client, "b-lm", "b-released", decision="approved")
    candidate = _team_version(client, "b-lm", "b-candidate")
    client.set_registered_model_alias("b-lm", "candidate", candidate)
    _team_version(client, "old-lm", "old-run", decision="rejected")
    return uri


def test_a_team_starts_from_its_own_models_and_from_versions_others_approved(
    registry: str,
) -> None:
    own = readable_checkpoint(registry, "models:/a-lm/1", "a")
    assert own[1] == "runs/a-run/checkpoints/step-10/gen-1/MANIFEST.json"
    released = readable_checkpoint(registry, "models:/b-lm/1", "a")
    assert released[1] == "runs/b-released/checkpoints/step-10/gen-1/MANIFEST.json"
    candidate = readable_checkpoint(registry, "models:/b-lm@candidate", "b")
    assert candidate[1] == "runs/b-candidate/checkpoints/step-10/gen-1/MANIFEST.json"


@pytest.mark.parametrize(
    ("uri", "owner", "decision"),
    [
        ("models:/b-lm@candidate", "team 'b'", "none"),
        ("models:/b-lm/2", "team 'b'", "none"),
        ("models:/old-lm/1", "no team", "rejected"),
    ],
)
def test_another_team_s_unapproved_version_is_refused_naming_whose_it_is(
    registry: str, uri: str, owner: str, decision: str
) -> None:
    with pytest.raises(ModelOfAnotherTeam) as refused:
        readable_checkpoint(registry, uri, "a")
    message = str(refused.value)
    assert message.startswith(f"model.init_from {uri!r}: model ")
    assert f"belongs to {owner}" in message and f"(decision: {decision})" in message
    assert "a run of team 'a' may start from its own team's models" in message


def test_a_run_from_before_runs_said_their_team_is_not_checked(registry: str) -> None:
    unchecked = readable_checkpoint(registry, "models:/b-lm/2", None)
    assert unchecked[1] == "runs/b-candidate/checkpoints/step-10/gen-1/MANIFEST.json"
