"""Bring a dataset's files or a checkpoint from the store into a node-local, verified cache."""

from __future__ import annotations

import logging
from pathlib import Path

from dataprep.dataset_manifest import DatasetManifest, load_manifest
from infra import code_snapshot
from infra.cache_budget import CacheBudget, CacheLease, default_budget
from infra.digest import is_sha256_hex
from infra.errors import IntegrityError
from infra.requirements import DeclaredKind, declared_environment, unmet
from infra.store.protocol import ObjectStore, fetch_verified
from infra.stored_format import StoredFile
from infra.user_envs import NodePython, UserEnv, ensure, environment_key
from trainer.checkpoint import fetch_checkpoint
from trainer.checkpoint_manifest import CheckpointManifest
from trainer.local_copies import LocalCopies
from trainer.manifest import read_manifest
from workflows.contracts.cluster_models import MAX_ADVERTISED_CACHED
from workflows.contracts.held_items import MAX_ADVERTISED_HELD, checkpoint_folder_item
from workflows.contracts.models import CheckpointRef, CodeRef, DatasetRef

log = logging.getLogger(__name__)


class NodeCache:
    """Content-addressed: a blob's path is its sha256, so one copy serves every run and a file
    already present is trusted only after its hash is checked again.

    Kept to a byte budget (infra.cache_budget): a fetch that would go over it evicts what was
    used longest ago first. A job fetches through a `lease()`, which pins what it fetched until
    the job ends; the methods here take a lease of their own for the one call."""

    def __init__(
        self,
        root: Path,
        store: ObjectStore,
        budget_bytes: int | None = None,
    ) -> None:
        self.root = root
        self.store = store
        self.budget = CacheBudget(
            root, default_budget(root) if budget_bytes is None else budget_bytes
        )

    def lease(self) -> NodeCacheLease:
        return NodeCacheLease(self, self.budget.lease())

    def held_snapshots(self) -> list[str]:
        """The dataset snapshots it holds whole, the most recently used first, at most
        MAX_ADVERTISED_CACHED of them (what agents before `held` advertised)."""
        return self.budget.held_snapshots()[:MAX_ADVERTISED_CACHED]

    def held(self) -> dict[str, int]:
        """What this node advertises (`NodeInfo.held`): the dataset snapshots and checkpoints it
        holds whole, by id with their bytes, the most recently used first, at most
        MAX_ADVERTISED_HELD of them."""
        held: dict[str, int] = {}
        for key, size in self.budget.held_whole()[:MAX_ADVERTISED_HELD]:
            folder = key.removeprefix("checkpoints/")
            held[checkpoint_folder_item(folder) if folder != key else key] = size
        return held

    def dataset_manifest(self, dataset: DatasetRef) -> DatasetManifest:
        return load_manifest(self.store, dataset.manifest_key, dataset.manifest_sha256)

    def split(self, manifest: DatasetManifest, split: str) -> list[Path]:
        with self.lease() as lease:
            return lease.split(manifest, split)

    def tokenizer(self, manifest: DatasetManifest) -> Path:
        with self.lease() as lease:
            return lease.tokenizer(manifest)

    def warm(self, manifest_key: str, hot: list[str]) -> int:
        """Fetch the checkpoint at `manifest_key` (verified) for runs to come, and keep the
        checkpoints whose ids are in `hot` over the rest when room is made; its bytes."""
        ref = CheckpointRef(manifest_key=manifest_key, step=0, generation=0, tokens_seen=0)
        _folder, manifest = self.checkpoint(ref)
        wanted = set(hot)
        self.budget.keep_hot(
            key for key, _ in self.budget.held_whole()
            if key.startswith("checkpoints/")
            and checkpoint_folder_item(key.removeprefix("checkpoints/")) in wanted
        )  # fmt: skip
        self.budget.save()
        return sum(entry.bytes for entry in manifest.files)

    def checkpoint(self, ref: CheckpointRef) -> tuple[Path, CheckpointManifest]:
        with self.lease() as lease:
            return lease.checkpoint(ref)

    def code(self, ref: CodeRef) -> Path:
        with self.lease() as lease:
            return lease.code(ref)


class NodeCacheLease:
    """The cache as one job sees it: everything it fetches or verifies stays until it closes."""

    def __init__(self, cache: NodeCache, pins: CacheLease) -> None:
        self.cache = cache
        self.pins = pins

    def __enter__(self) -> NodeCacheLease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.pins.close()

    def dataset_manifest(self, dataset: DatasetRef) -> DatasetManifest:
        return self.cache.dataset_manifest(dataset)

    def split(self, manifest: DatasetManifest, split: str) -> list[Path]:
        try:
            paths = [self._blob(shard) for shard in manifest.splits[split].shards]
            # The manifest's sha256 was checked: the snapshot id is its own.
            self.cache.budget.hold_snapshot(
                manifest.snapshot_id, (f"blobs/{p.name}" for p in paths)
            )
            return paths
        finally:
            self.cache.budget.save()

    def tokenizer(self, manifest: DatasetManifest) -> Path:
        try:
            return self._blob(manifest.tokenizer)
        finally:
            self.cache.budget.save()

    def checkpoint(
        self, ref: CheckpointRef, copies: LocalCopies | None = None
    ) -> tuple[Path, CheckpointManifest]:
        """The checkpoint's files in one folder (DCP reads them by name) and its manifest;
        `copies`: the files the run's ranks on this node committed last, read before the store."""
        manifest = read_manifest(self.cache.store, ref.manifest_key)
        rel = "checkpoints/" + ref.manifest_key.rsplit("/", 1)[0]
        folder = self.cache.root / rel
        size = sum(entry.bytes for entry in manifest.files)
        try:
            self.pins.admit(
                rel, size, lambda: self._fetch_checkpoint(manifest, folder, size, copies)
            )
        finally:
            self.cache.budget.save()
        return folder, manifest

    def _fetch_checkpoint(
        self, manifest: CheckpointManifest, folder: Path, size: int, copies: LocalCopies | None
    ) -> Path:
        if copies is None:
            return fetch_checkpoint(self.cache.store, manifest, folder)
        before = copies.served_bytes
        fetch_checkpoint(self.cache.store, manifest, folder, copies)
        # What a recovery saved: the on-call reads it in the agent's log.
        log.info(
            "checkpoint step %s: %s of %s bytes from this node's own copies, the rest from "
            "the store", manifest.step, f"{copies.served_bytes - before:,}", f"{size:,}",
        )  # fmt: skip
        return folder

    def code(self, ref: CodeRef) -> Path:
        """The user's code snapshot, each file checked against the manifest the run carries."""
        rel = f"code/{ref.snapshot_id}"
        dest = self.cache.root / rel
        store = self.cache.store
        try:
            return self.pins.admit(
                rel,
                ref.bytes,
                lambda: code_snapshot.fetch(store, ref.snapshot_id, ref.manifest_sha256, dest),
            )
        finally:
            self.cache.budget.save()

    def environment(self, code_dir: Path) -> UserEnv | None:
        """The Python environment the code folder's requirements declare, built here once and
        shared by every run that declares the same (infra.user_envs); None when it declares
        none, or only what the node has. Its size is known once it is built: room is made after
        the fact."""
        wanted = declared_environment(code_dir)
        if wanted is None or (wanted.kind is DeclaredKind.REQUIREMENTS and not unmet(code_dir)):
            # What it asks for is what the node has (`torch>=2.6`): the node's interpreter, and
            # its warm standby, serve it as they serve a folder without requirements.
            return None
        node = NodePython.this()
        rel = f"envs/{environment_key(wanted, node)}"
        folder = self.cache.root / rel
        try:
            return self.pins.admit(rel, 0, lambda: ensure(wanted, folder, node))
        finally:
            self.cache.budget.save()

    def _blob(self, entry: StoredFile) -> Path:
        sha256 = entry.sha256
        # The name of the cached file comes from a manifest read from the store: only a hex
        # digest may become a path here, never "../" or a name a crafted manifest chose.
        if not is_sha256_hex(sha256):
            raise IntegrityError(f"{entry.key!r}: manifest sha256 {sha256!r} is not a hex digest")
        rel = f"blobs/{sha256}"
        dest = self.cache.root / rel
        store = self.cache.store
        return self.pins.admit(
            rel, entry.bytes, lambda: fetch_verified(store, entry.key, dest, sha256, entry.bytes)
        )  # fmt: skip
