"""A registered version's model folder, fetched from MLflow and checked file by file before
anything loads it: against the record of every file its registration made
(`registry.model_files`, whose digest the version's `forgeline.model_files_sha256` tag holds),
or, for a version registered before that record, against the digests of its weights, config and
tokenizer (`forgeline.artifacts_sha256`), saying which files went unchecked. `serve` and
`generate` load exactly the folder that was checked, never the registry's copy again, so files
changed in the artifact store after registration are not loaded."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from infra.digest import sha256_bytes, sha256_file
from infra.stored_format import StoredFormatError
from registry.model_files import MODEL_FILES_ARTIFACT, ModelFiles, files_in
from registry.names import ARTIFACTS_TAG, MODEL_FILES_TAG

_PROGRESS_BAR = "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"


class UnverifiedModel(Exception):
    """The version's files do not match its registration; the message says which."""


@dataclass(frozen=True)
class VerifiedFolder:
    """A downloaded model folder and how far it was checked."""

    path: Path
    files: int  # how many files it holds
    unchecked: tuple[str, ...] = ()  # files no record covers (a version from before the record)

    @property
    def summary(self) -> str:
        if not self.unchecked:
            return f"all {self.files} files verified"
        return (
            "files verified only in part: its weights, config and tokenizer; registered before "
            "Forgeline recorded every file, so these were not checked: " + ", ".join(self.unchecked)
        )


def fetch_verified(tracking_uri: str, name: str, version: str, dest: Path) -> VerifiedFolder:
    """Download version `version` of `name` into `dest` and check it: every recorded file
    present with its recorded sha256, and (with the full record) no file besides."""
    import mlflow.artifacts  # late: MLflow costs every `forgeline` command a second to import
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
    found = client.get_model_version(name, version)
    what = f"{name} version {version}"
    source = client.get_model_version_download_uri(name, version)
    with _no_progress_bar():  # `generate` prints the model's text and nothing else
        folder = Path(
            mlflow.artifacts.download_artifacts(
                artifact_uri=source, dst_path=str(dest), tracking_uri=tracking_uri
            )
        )
        tag = found.tags.get(MODEL_FILES_TAG)
        if tag is not None:
            record = _model_files(tracking_uri, found.run_id, tag, what)
            _check_whole(folder, record, what)
            return VerifiedFolder(folder, len(record.files))
    recorded = _recorded(found.tags.get(ARTIFACTS_TAG), what)
    _check_digests(folder, recorded, what)
    present = files_in(folder)
    return VerifiedFolder(folder, len(present), tuple(sorted(set(present) - set(recorded))))


def _model_files(tracking_uri: str, run_id: str, digest: str, what: str) -> ModelFiles:
    """The record of the version's files, from its run, checked against the tagged digest."""
    import mlflow.artifacts
    from mlflow.exceptions import MlflowException

    where = f"{what}'s {MODEL_FILES_ARTIFACT}"
    with tempfile.TemporaryDirectory(prefix="forgeline-record-") as scratch:
        try:
            path = mlflow.artifacts.download_artifacts(
                run_id=run_id, artifact_path=MODEL_FILES_ARTIFACT, dst_path=scratch,
                tracking_uri=tracking_uri,
            )  # fmt: skip
            raw = Path(path).read_bytes()
        except (MlflowException, OSError):
            raise UnverifiedModel(
                f"{where}, the record of its files, is gone from MLflow run {run_id}: refusing "
                "to load what cannot be checked; register it again from its run"
            ) from None
    if sha256_bytes(raw) != digest:
        raise UnverifiedModel(
            f"{where} is not the record its registration made (its sha256 is not the "
            f"{MODEL_FILES_TAG} tag's): refusing to load it; register it again from its run"
        )
    try:
        return ModelFiles.parse(raw, where)
    except StoredFormatError as err:
        raise UnverifiedModel(str(err)) from None


def _check_whole(folder: Path, record: ModelFiles, what: str) -> None:
    problem = record.first_difference(folder)
    if problem is not None:
        raise UnverifiedModel(
            f"{what}: {problem}: refusing to load it; register it again from its run's "
            "checkpoint (`forgeline lineage` traces it)"
        )


def _check_digests(folder: Path, recorded: dict[str, str], what: str) -> None:
    for relative, expected in sorted(recorded.items()):
        path = folder / relative
        if not path.is_file():
            raise UnverifiedModel(
                f"{what} has no {relative}, which its registration recorded: "
                "its files were changed after it was registered; register it again from its run"
            )
        actual = sha256_file(path)
        if actual != expected:
            raise UnverifiedModel(
                f"{what}'s {relative} is not the file it was registered with "
                f"(sha256 {actual[:12]}…, registered {expected[:12]}…): refusing to load it; "
                "register it again from its run's checkpoint (`forgeline lineage` traces it)"
            )


@contextlib.contextmanager
def _no_progress_bar() -> Iterator[None]:
    previous = os.environ.get(_PROGRESS_BAR)
    os.environ[_PROGRESS_BAR] = "false"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(_PROGRESS_BAR, None)
        else:
            os.environ[_PROGRESS_BAR] = previous


def _recorded(raw: str | None, what: str) -> dict[str, str]:
    try:
        recorded = json.loads(raw) if raw else None
    except ValueError:
        recorded = None
    valid = (
        isinstance(recorded, dict)
        and recorded
        and all(
            isinstance(k, str) and isinstance(v, str) and _inside(k) for k, v in recorded.items()
        )
    )
    if not valid:
        raise UnverifiedModel(
            f"{what} carries no valid record of its files' digests ({ARTIFACTS_TAG}): it was "
            "registered before Forgeline recorded them, or the tag was edited; register it "
            "again from its run"
        )
    return recorded  # type: ignore[return-value]


def _inside(relative: str) -> bool:
    path = PurePosixPath(relative)
    return not path.is_absolute() and ".." not in path.parts and "\\" not in relative
