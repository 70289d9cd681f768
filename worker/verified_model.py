"""A registered version's model folder, fetched from MLflow and checked file by file against the
digests its registration recorded (`forgeline.artifacts_sha256`), before anything loads it:
`serve` and `generate` load exactly the folder that was checked, never the registry's copy
again, so weights changed in the artifact store after registration are not served."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path, PurePosixPath

from infra.digest import sha256_file
from registry.names import ARTIFACTS_TAG

_PROGRESS_BAR = "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"


class UnverifiedModel(Exception):
    """The version's files do not match its registration; the message says which."""


def fetch_verified(tracking_uri: str, name: str, version: str, dest: Path) -> Path:
    """Download version `version` of `name` into `dest`; its model folder, every recorded file
    present with its recorded sha256."""
    import mlflow.artifacts  # late: MLflow costs every `forgeline` command a second to import
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
    found = client.get_model_version(name, version)
    recorded = _recorded(found.tags.get(ARTIFACTS_TAG), f"{name} version {version}")
    source = client.get_model_version_download_uri(name, version)
    with _no_progress_bar():  # `generate` prints the model's text and nothing else
        folder = Path(
            mlflow.artifacts.download_artifacts(
                artifact_uri=source, dst_path=str(dest), tracking_uri=tracking_uri
            )
        )
    for relative, expected in sorted(recorded.items()):
        path = folder / relative
        if not path.is_file():
            raise UnverifiedModel(
                f"{name} version {version} has no {relative}, which its registration recorded: "
                "its files were changed after it was registered; register it again from its run"
            )
        actual = sha256_file(path)
        if actual != expected:
            raise UnverifiedModel(
                f"{name} version {version}'s {relative} is not the file it was registered with "
                f"(sha256 {actual[:12]}…, registered {expected[:12]}…): refusing to load it; "
                "register it again from its run's checkpoint (`forgeline lineage` traces it)"
            )
    return folder


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
