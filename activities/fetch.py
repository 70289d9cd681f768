"""Bring a dataset's files or a checkpoint from the store into a node-local, verified cache."""

from __future__ import annotations

import re
from pathlib import Path

from dataprep.dataset_manifest import load_manifest
from infra import code_snapshot
from infra.errors import IntegrityError
from infra.store import ObjectStore, fetch_verified
from trainer.checkpoint import fetch_checkpoint
from trainer.manifest import read_manifest
from workflows.models import CheckpointRef, CodeRef, DatasetRef

_SHA256 = re.compile(r"[0-9a-f]{64}")


class NodeCache:
    """Content-addressed: a blob's path is its sha256, so one copy serves every run and a file
    already present is trusted only after its hash is checked again."""

    def __init__(self, root: Path, store: ObjectStore) -> None:
        self.root = root
        self.store = store

    def _blob(self, entry: dict) -> Path:
        sha256 = entry["sha256"]
        # The name of the cached file comes from a manifest read from the store: only a hex
        # digest may become a path here, never "../" or a name a crafted manifest chose.
        if not isinstance(sha256, str) or not _SHA256.fullmatch(sha256):
            raise IntegrityError(
                f"{entry.get('key')!r}: manifest sha256 {sha256!r} is not a hex digest"
            )
        dest = self.root / "blobs" / sha256
        return fetch_verified(self.store, entry["key"], dest, sha256, entry["bytes"])

    def dataset_manifest(self, dataset: DatasetRef) -> dict:
        return load_manifest(self.store, dataset.manifest_key, dataset.manifest_sha256)

    def split(self, manifest: dict, split: str) -> list[Path]:
        return [self._blob(shard) for shard in manifest["splits"][split]["shards"]]

    def tokenizer(self, manifest: dict) -> Path:
        return self._blob(manifest["tokenizer"])

    def checkpoint(self, ref: CheckpointRef) -> tuple[Path, dict]:
        """The checkpoint's files in one folder (DCP reads them by name) and its manifest."""
        manifest = read_manifest(self.store, ref.manifest_key)
        folder = self.root / "checkpoints" / ref.manifest_key.rsplit("/", 1)[0]
        return fetch_checkpoint(self.store, manifest, folder), manifest

    def code(self, ref: CodeRef) -> Path:
        """The user's code snapshot, each file checked against the manifest the run carries."""
        return code_snapshot.fetch(
            self.store, ref.snapshot_id, ref.manifest_sha256, self.root / "code" / ref.snapshot_id
        )
