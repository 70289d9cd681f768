"""`forgeline lineage NAME VERSION`: a model version traced back to its data, code and checkpoint,
with every hash checked against the store now (not just what was recorded then).

    version → MLflow run → checkpoint manifest (every file's sha256) → dataset snapshot (manifest
    sha256, sources, filter and dedup counts) → code commit → run spec → Temporal history
"""

from __future__ import annotations

import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import typer

from dataprep.dataset_manifest import DatasetManifest
from infra import code_snapshot
from infra.digest import sha256_bytes
from infra.errors import IntegrityError, ObjectNotFound
from infra.processes import http_ok
from infra.settings import Settings
from infra.store.protocol import ObjectStore, verify_stored_files
from infra.stored_format import StoredFormatError
from registry.lineage_tags import LineageTags
from registry.names import CHECKPOINT_TAG, DECISION_TAG, IDEMPOTENCY_TAG
from trainer.manifest import read_manifest
from worker.cli_common import CliError, ExitCode, check_name, console, get_settings
from worker.serve import ALIAS_PATTERN

commands = typer.Typer()


@dataclass(frozen=True)
class Link:
    what: str
    detail: str
    check: str = ""  # "ok", or what is wrong; empty where there is nothing to check

    @property
    def broken(self) -> bool:
        return self.check not in ("", "ok")


class LineageError(Exception):
    """The version is not in the registry, or was not made by forgeline."""


@commands.command("lineage")
def lineage_command(
    name: Annotated[str, typer.Argument(help="registered model name")],
    version: Annotated[str, typer.Argument(help="a version number, or @ALIAS")],
) -> None:
    """A model version traced to its checkpoint, data, code and Temporal history, every hash
    checked against the store; exits 1 when one does not match."""
    settings = get_settings()
    check_name(name, "model name")
    check_version(version)
    # MlflowClient retries an unreachable server with back-off for minutes; ask once, quickly.
    uri = settings.mlflow_uri
    if uri.startswith(("http://", "https://")) and not http_ok(f"{uri}/health"):
        raise CliError(
            f"cannot reach MLflow at {uri}: start the local stack with `forgeline up`",
            ExitCode.DOWN,
        )
    try:
        links = trace(settings, settings.open_store(), name, version)
    except LineageError as err:
        raise CliError(str(err), ExitCode.NOT_FOUND) from None
    for link in links:
        mark = {"": "", "ok": "  [verified]"}.get(link.check, f"  [BROKEN: {link.check}]")
        console.print(f"{link.what:<11} {link.detail}{mark}", markup=False)
    if any(link.broken for link in links):
        raise typer.Exit(ExitCode.RUN_FAILED)


def check_version(version: str) -> str:
    """A version number or @ALIAS, before it reaches the registry's URLs."""
    number = re.fullmatch(r"[1-9][0-9]{0,8}", version)
    alias = version.startswith("@") and re.fullmatch(ALIAS_PATTERN, version[1:])
    if not (number or alias):
        raise CliError(
            f"version {version[:80]!r} is neither a number (3) nor an alias (@production)"
        )
    return version


def trace(settings: Settings, store: ObjectStore, name: str, version: str) -> list[Link]:
    # Late: importing MLflow costs every `forgeline` command 1.4 s, and only this one needs it.
    from mlflow.tracking import MlflowClient

    from registry.tracking import lookup_version

    client = MlflowClient(tracking_uri=settings.mlflow_uri, registry_uri=settings.mlflow_uri)
    if version.startswith("@"):
        found = lookup_version(client, name, alias=version[1:])
    else:
        found = lookup_version(client, name, version=version)
    if found is None:
        raise LineageError(
            f"{name} version {version} is not in the registry at {settings.mlflow_uri}"
        ) from None
    tags = found.tags
    if CHECKPOINT_TAG not in tags:
        raise LineageError(f"{name} version {version} has no forgeline lineage tags")
    try:
        lineage = LineageTags.read(tags, f"{name} version {found.version}")
    except StoredFormatError as err:
        raise LineageError(str(err)) from None
    run = client.get_run(found.run_id)
    aliases = ", ".join(found.aliases) or "none"
    code = f"git {lineage.git_commit}"
    if lineage.git_dirty:
        code += " (with uncommitted changes)"
    history = f"{settings.temporal_ui_url}/namespaces/{settings.temporal_namespace}/workflows"
    workflow = f"{history}/{lineage.temporal_workflow_id}/{tags.get(IDEMPOTENCY_TAG, '')}"
    return [
        Link("version", f"{name} v{found.version} (aliases: {aliases}); {_decision(tags)}"),
        Link("mlflow run", f"{run.info.run_name} ({found.run_id})"),
        _checkpoint(store, lineage.checkpoint_manifest_key),
        _dataset(store, lineage.dataset_manifest_key, lineage.dataset_manifest_sha256),
        Link("code", code),
        *([_user_code(store, lineage)] if lineage.code_snapshot else []),
        Link("spec", f"sha256 {lineage.spec_sha256}"),
        Link("temporal", workflow.rstrip("/")),
    ]


def _decision(tags: dict[str, str]) -> str:
    decision = tags.get(DECISION_TAG)
    if decision is None:
        return "waiting for approval"
    return f"{decision} by {tags.get('forgeline.decided_by', '?')}"


def _checkpoint(store: ObjectStore, key: str) -> Link:
    try:
        manifest = read_manifest(store, key)
        verify_stored_files(store, manifest.files, "checkpoint file")  # the bytes, hashed
    except (IntegrityError, ObjectNotFound) as err:
        return Link("checkpoint", key, str(err))
    detail = (
        f"{key}: step {manifest.step}, generation {manifest.generation}, "
        f"{len(manifest.files)} files, {manifest.tokens_seen:,} tokens seen"
    )
    return Link("checkpoint", detail, "ok")


def _user_code(store: ObjectStore, lineage: LineageTags) -> Link:
    """The user's code snapshot that trained the version, every file checked against the
    manifest whose digest the version recorded (fetched to a scratch folder: code is small)."""
    snapshot = lineage.code_snapshot or ""
    entry = "?" if lineage.entrypoint is None else lineage.entrypoint
    try:
        with tempfile.TemporaryDirectory(prefix="forgeline-lineage-") as scratch:
            folder = code_snapshot.fetch(
                store, snapshot, lineage.code_manifest_sha256 or "", Path(scratch)
            )
            files = sum(1 for p in folder.rglob("*") if p.is_file())
    except (IntegrityError, ObjectNotFound) as err:
        return Link("user code", f"{code_snapshot.manifest_key(snapshot)}", str(err))
    return Link("user code", f"snapshot {snapshot}: {files} files, entrypoint {entry}", "ok")


def _dataset(store: ObjectStore, key: str, recorded_sha256: str) -> Link:
    try:
        data = store.get_bytes(key)
    except ObjectNotFound:
        return Link("dataset", key, "the snapshot's manifest is gone from the store")
    if sha256_bytes(data) != recorded_sha256:
        return Link("dataset", key, f"manifest sha256 is not the recorded {recorded_sha256[:12]}…")
    try:
        manifest = DatasetManifest.parse(data, key)
        files = manifest.files()
        verify_stored_files(store, files, "dataset file")
    except IntegrityError as err:
        return Link("dataset", key, str(err))
    docs = manifest.documents
    sources = ", ".join(s.path for s in manifest.sources)
    detail = (
        f"snapshot {manifest.snapshot_id} from {sources}: {docs.read:,} documents read, "
        f"{docs.filtered:,} filtered, {docs.exact_duplicates + docs.near_duplicates:,} "
        f"duplicates removed; train {docs.train:,} / val {docs.val:,} documents; "
        f"{len(files)} files"
    )
    return Link("dataset", detail, "ok")
