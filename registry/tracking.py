"""Register a trained model in MLflow with its lineage, and record the approval decision.

Registration is idempotent on the workflow run id: a retried activity finds the version it
created before instead of registering a second one.
"""

from __future__ import annotations

import importlib.util
import json
import posixpath
import shutil
import tempfile
import time
import warnings
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import mlflow
from mlflow.data.dataset_source_registry import resolve_dataset_source
from mlflow.data.meta_dataset import MetaDataset
from mlflow.entities import FileInfo, Metric, Param, RunTag
from mlflow.entities.model_registry import ModelVersion
from mlflow.store.artifact.artifact_repo import ArtifactRepository
from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository
from mlflow.tracking import MlflowClient

from infra.digest import sha256_bytes, sha256_file
from registry.errors import ModelOfAnotherTeam, VersionNotFound
from registry.model_files import MODEL_FILES_ARTIFACT, ModelFile, ModelFiles
from registry.names import (
    ARTIFACTS_TAG,
    CANDIDATE,
    CHECKPOINT_TAG,
    DECISION_TAG,
    EXPERIMENT,
    IDEMPOTENCY_TAG,
    MODEL_FILES_TAG,
    PRODUCTION,
    TEAM_TAG,
)

if TYPE_CHECKING:
    # A name for the annotation only: mlflow.models' signatures need pandas, which the base
    # install (mlflow-skinny, on every GPU host) lacks, and every CLI command imports this module.
    from mlflow.models import ModelSignature

_MAX_PARAM_LENGTH = 6000


@dataclass(frozen=True)
class RegisteredVersion:
    model_name: str
    version: str
    mlflow_run_id: str


@dataclass(frozen=True)
class DatasetUsed:
    """The dataset snapshot a model was trained on, as an MLflow run input."""

    name: str
    uri: str  # where its manifest is: file:///... or s3://...
    digest: str
    tags: dict[str, str] = field(default_factory=dict)


@dataclass
class Registration:
    """Everything MLflow records about one trained model."""

    model_name: str
    run_name: str
    params: dict[str, Any]
    metrics: dict[str, float]
    metric_series: dict[str, list[tuple[int, float]]]
    run_tags: dict[str, str]
    version_tags: dict[str, str]
    artifacts: dict[str, str]
    # A models-from-code file (MLflow runs it at load), never a PythonModel object: an object is
    # cloudpickled, so loading it would need the packages its classes live in, and would run
    # whatever the pickle says.
    # None: a weights-only version (the artifacts and lineage, no pyfunc to load).
    python_model: str | None
    signature: ModelSignature | None
    pip_requirements: list[str]  # all the version needs, and only that: nothing is inferred
    idempotency_key: str
    code_modules: tuple[str, ...] = ()  # shipped in the version, at their package paths
    code_files: tuple[str, ...] = ()  # shipped as they are, by name (a user's code snapshot)
    model_config: dict[str, Any] | None = None  # for the models-from-code file (load_context)
    texts: dict[str, str] = field(default_factory=dict)  # file name -> content, on the run
    mlflow_run_id: str | None = None  # the run opened at the start (open_run); None: a new one
    dataset: DatasetUsed | None = None
    team: str = ""  # the run's team: the model must be its own, or new ("": not checked)
    # A weights-only version of a script that keeps its own checkpoints: its files, by their
    # path in the script's folder, kept at that path in the version's model folder.
    folder_files: dict[str, str] = field(default_factory=dict)


def flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """{"train": {"steps": 5}} -> {"train.steps": "5"}: MLflow params are flat strings."""
    flat: dict[str, str] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = str(value)[:_MAX_PARAM_LENGTH]
    return flat


def _client(tracking_uri: str) -> MlflowClient:
    mlflow.set_tracking_uri(tracking_uri)
    mlflow.set_registry_uri(tracking_uri)
    return MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)


def find_version(client: MlflowClient, model_name: str, key: str) -> RegisteredVersion | None:
    try:
        versions = client.search_model_versions(
            f"name = '{model_name}' and tags.`{IDEMPOTENCY_TAG}` = '{key}'"
        )
    except mlflow.exceptions.MlflowException:
        return None
    for version in versions:
        return RegisteredVersion(model_name, version.version, version.run_id)
    return None


def register(tracking_uri: str, reg: Registration) -> RegisteredVersion:
    client = _client(tracking_uri)
    existing = find_version(client, reg.model_name, reg.idempotency_key)
    if existing is not None:
        return existing
    # Before anything is logged: a refused version leaves no trace in the other team's model.
    model_name = _ensure_registered_model(client, reg.model_name, reg.team)

    mlflow.set_experiment(EXPERIMENT)
    started = (
        mlflow.start_run(run_id=reg.mlflow_run_id)
        if reg.mlflow_run_id
        else mlflow.start_run(run_name=reg.run_name)
    )
    with started as run:
        run_id = run.info.run_id
        now = int(time.time() * 1000)
        client.log_batch(
            run_id,
            params=[Param(k, v) for k, v in flatten(reg.params).items()],
            tags=[
                RunTag(k, v)
                for k, v in {**reg.run_tags, IDEMPOTENCY_TAG: reg.idempotency_key}.items()
            ],
        )
        metrics = [Metric(k, v, now, 0) for k, v in reg.metrics.items()]
        for key, series in reg.metric_series.items():
            metrics += [Metric(key, value, now, step) for step, value in series]
        for start in range(0, len(metrics), 1000):  # log_batch takes at most 1000 metrics
            client.log_batch(run_id, metrics=metrics[start : start + 1000])
        for name, text in reg.texts.items():
            mlflow.log_text(text, name)
        if reg.dataset is not None:
            mlflow.log_input(_as_input(reg.dataset), context="training", tags=reg.dataset.tags)
        if reg.python_model is None:
            for path in reg.artifacts.values():
                mlflow.log_artifact(path, artifact_path="model")
            for name, path in reg.folder_files.items():
                mlflow.log_artifact(
                    path, artifact_path=posixpath.join("model", posixpath.dirname(name)).rstrip("/")
                )
            source, model_id = f"{run.info.artifact_uri}/model", None
            location = source
        else:
            with tempfile.TemporaryDirectory(prefix="forgeline-code-") as code:
                shipped = stage_modules(reg.code_modules, Path(code)) + list(reg.code_files)
                info = mlflow.pyfunc.log_model(
                    name="model",
                    python_model=reg.python_model,
                    code_paths=shipped or None,
                    model_config=reg.model_config,
                    signature=reg.signature,
                    artifacts=reg.artifacts,
                    pip_requirements=reg.pip_requirements,
                )
            source, model_id = info.model_uri, info.model_id
            location = client.get_logged_model(model_id).artifact_location
        # Every file of the folder, its code and MLmodel too, recorded before the version
        # exists: a version is never without its record.
        files = record_model_files(location, artifact_paths(reg))
        record = files.dump_bytes()
        mlflow.log_text(record.decode(), MODEL_FILES_ARTIFACT)
    recorded = files.by_path()
    version = client.create_model_version(
        name=model_name,
        source=source,
        run_id=run_id,
        model_id=model_id,
        tags={
            **reg.version_tags,
            IDEMPOTENCY_TAG: reg.idempotency_key,
            # Still written: a build from before the full record checks these three files.
            ARTIFACTS_TAG: json.dumps(
                {path: recorded[path].sha256 for path in artifact_paths(reg)}, sort_keys=True
            ),
            MODEL_FILES_TAG: sha256_bytes(record),
        },
    )
    client.set_registered_model_alias(reg.model_name, CANDIDATE, version.version)
    return RegisteredVersion(reg.model_name, version.version, run_id)


def artifact_paths(reg: Registration) -> dict[str, Path]:
    """Where each artifact lands in the version's model folder, and its file here: a pyfunc
    model keeps them under artifacts/, a weights-only version at the folder's top."""
    folder = "artifacts/" if reg.python_model is not None else ""
    files = [Path(path) for path in reg.artifacts.values()]
    kept = {name: Path(path) for name, path in reg.folder_files.items()}
    return {f"{folder}{path.name}": path for path in files} | kept


def record_model_files(location: str, uploaded: Mapping[str, Path]) -> ModelFiles:
    """Every file the model folder at `location` holds as stored, with its size and sha256.
    The weights were hashed here rather than fetched back (`uploaded`: the same bytes, unless
    the store holds another size); everything MLflow wrote (MLmodel, code, requirements) is
    fetched and hashed, as it is small."""
    repo = get_artifact_repository(location)
    files = []
    with tempfile.TemporaryDirectory(prefix="forgeline-record-") as scratch:
        for entry in _every_file(repo, ""):
            local = uploaded.get(entry.path)
            if local is None or local.stat().st_size != entry.file_size:
                local = Path(repo.download_artifacts(entry.path, scratch))
            size = local.stat().st_size
            files.append(ModelFile(path=entry.path, bytes=size, sha256=sha256_file(local)))
    return ModelFiles(files=files)


def _every_file(repo: ArtifactRepository, path: str) -> Iterator[FileInfo]:
    for entry in repo.list_artifacts(path):
        if entry.is_dir:
            yield from _every_file(repo, entry.path)
        else:
            yield entry


def stage_modules(modules: Iterable[str], dest: Path) -> list[str]:
    """Copy each module's source to `dest` at its package path (a.b.c -> dest/a/b/c.py), with the
    `__init__.py` of every package above it; returns the top-level folders and files, which are
    what `code_paths` takes (MLflow copies each one into the version's code/ folder by name)."""
    tops: set[Path] = set()
    for name in modules:
        parts = name.split(".")
        for depth in range(1, len(parts) + 1):
            spec = importlib.util.find_spec(".".join(parts[:depth]))
            if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
                raise ValueError(f"{name}: {'.'.join(parts[:depth])} has no Python source to ship")
            is_package = spec.submodule_search_locations is not None
            if is_package:
                target = dest.joinpath(*parts[:depth], "__init__.py")
            else:
                target = dest.joinpath(*parts[:depth]).with_suffix(".py")
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(spec.origin, target)
        top = dest / parts[0]
        tops.add(top if top.is_dir() else top.with_suffix(".py"))
    return sorted(str(top) for top in tops)


def _as_input(dataset: DatasetUsed) -> MetaDataset:
    with warnings.catch_warnings():  # a file:// URI matches two equivalent source types
        warnings.simplefilter("ignore")
        source = resolve_dataset_source(dataset.uri)
    # MLflow keeps at most 36 characters of a digest.
    return MetaDataset(source, name=dataset.name, digest=dataset.digest[:32])


def open_run(
    tracking_uri: str, run_name: str, key: str, params: Mapping[str, Any], tags: dict[str, str]
) -> str:
    """The MLflow run that tracks a training run from its start (metrics stream into it as
    the ranks train; registration logs the model into it). Idempotent on `key`."""
    client = _client(tracking_uri)
    experiment = mlflow.set_experiment(EXPERIMENT)
    found = client.search_runs(
        [experiment.experiment_id], f"tags.`{IDEMPOTENCY_TAG}` = '{key}'", max_results=1
    )
    if found:
        return found[0].info.run_id
    run = client.create_run(
        experiment.experiment_id, run_name=run_name, tags={**tags, IDEMPOTENCY_TAG: key}
    )
    client.log_batch(run.info.run_id, params=[Param(k, v) for k, v in flatten(params).items()])
    return run.info.run_id


def close_run(tracking_uri: str, run_id: str, status: str, error: str = "") -> None:
    """End a run that produced no model (FAILED, or KILLED when cancelled) with the reason, so
    the MLflow UI does not show it RUNNING forever. Idempotent."""
    client = _client(tracking_uri)
    if error:
        client.set_tag(run_id, "forgeline.error", error[:5000])
    client.set_terminated(run_id, status=status)


def _ensure_registered_model(client: MlflowClient, name: str, team: str) -> str:
    """The registered model, made for `team` when it is new (tagged in the same call, so two
    teams racing for a new name cannot both win); an existing one must be `team`'s."""
    tags = {TEAM_TAG: team} if team else None
    try:
        client.create_registered_model(name, tags=tags, description="Trained by Forgeline")
        return name
    except mlflow.exceptions.MlflowException as err:
        if err.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
    owner = model_team(client, name)
    if team and owner is None:
        # Registered before models had teams: the first team to register it now claims it.
        client.set_registered_model_tag(name, TEAM_TAG, team)
    elif team and owner != team:
        raise ModelOfAnotherTeam(
            f"model {name!r} belongs to team {owner!r}, which registered it first: a run of "
            f"team {team!r} may not add versions to it; set registry.model_name to a name of "
            "your team's"
        )
    return name


def model_team(client: MlflowClient, name: str) -> str | None:
    """The team a registered model belongs to (None: it does not exist, or predates teams)."""
    try:
        return client.get_registered_model(name).tags.get(TEAM_TAG)
    except mlflow.exceptions.MlflowException as err:
        if err.error_code == "RESOURCE_DOES_NOT_EXIST":
            return None
        raise


def record_decision(
    tracking_uri: str,
    model_name: str,
    version: str,
    *,
    approver: str,
    approve: bool,
    reason: str,
    decided_at: datetime,
    expired: bool = False,
    extra_tags: Mapping[str, str] | None = None,
) -> None:
    """Tag the version with who decided what and when; on approval move `production` to it.
    An expired approval window is recorded as the decision `expired`, and moves nothing."""
    client = _client(tracking_uri)
    try:
        client.get_model_version(model_name, version)
    except mlflow.exceptions.MlflowException:
        raise VersionNotFound(f"model {model_name} has no version {version}") from None
    decision = "expired" if expired else ("approved" if approve else "rejected")
    tags = {
        DECISION_TAG: decision,
        "forgeline.decided_by": approver,
        "forgeline.decided_at": decided_at.isoformat(),
        "forgeline.decision_reason": reason,
        **(extra_tags or {}),
    }
    for key, value in tags.items():
        client.set_model_version_tag(model_name, version, key, value)
    if approve and not expired:
        client.set_registered_model_alias(model_name, PRODUCTION, version)


def metric_history(
    tracking_uri: str, run_id: str, keys: Iterable[str] | None = None
) -> dict[str, list[Metric]]:
    """The run's metric series by key, each by step (every key it has when none are given)."""
    client = _client(tracking_uri)
    wanted = list(keys or sorted(client.get_run(run_id).data.metrics))
    return {
        key: sorted(client.get_metric_history(run_id, key), key=lambda m: (m.step, m.timestamp))
        for key in wanted
    }


def lookup_version(
    client: MlflowClient, name: str, *, alias: str | None = None, version: str | None = None
) -> ModelVersion | None:
    """The version an alias (or a number) names now, or None when there is none: callers say
    what is missing in their own words."""
    try:
        if alias:
            return client.get_model_version_by_alias(name, alias)
        return client.get_model_version(name, str(version))
    except mlflow.exceptions.MlflowException:
        return None


def checkpoint_of(tracking_uri: str, uri: str) -> tuple[str, str]:
    """The checkpoint manifest a registered version was made from, for fine-tuning.

    `uri` is models:/NAME/VERSION or models:/NAME@ALIAS; returns (version, manifest key).
    """
    client = _client(tracking_uri)
    path = uri.removeprefix("models:/")
    if "@" in path:
        name, alias = path.split("@", 1)
        found = lookup_version(client, name, alias=alias)
    else:
        name, version = path.rsplit("/", 1)
        found = lookup_version(client, name, version=version)
    if found is None:
        raise VersionNotFound(
            f"{uri} is not in the registry at {tracking_uri}: check the name and the version "
            "or alias (`forgeline runs` lists what was registered)"
        ) from None
    key = found.tags.get(CHECKPOINT_TAG)
    if not key:
        raise VersionNotFound(f"{uri} (version {found.version}) carries no {CHECKPOINT_TAG} tag")
    return found.version, key
