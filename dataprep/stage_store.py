"""Where stages keep their outputs, and the done-records that make them idempotent.

A stage writes its files, then one JSON record listing them with size and sha256, last and
create-if-absent: a chunk with a record whose files verify is done and is skipped on retry;
anything else (killed midway, half uploaded) is redone from scratch.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from infra.digest import sha256_file
from infra.errors import IntegrityError, ObjectNotFound
from infra.store.local import LocalStore
from infra.store.protocol import ObjectStore, check_claimed_files, fetch_verified
from infra.stored_format import StoredFile, StoredRecord


class SnapshotKeys:
    """The store layout of one snapshot."""

    def __init__(self, snapshot_id: str) -> None:
        self.root = f"datasets/{snapshot_id}"

    @property
    def manifest(self) -> str:
        return f"{self.root}/MANIFEST.json"

    @property
    def plan(self) -> str:
        return f"{self.root}/work/plan.json"

    def work(self, stage: str, name: str) -> str:
        return f"{self.root}/work/{stage}/{name}"

    def chunk_record(self, stage: str, index: int) -> str:
        return self.work(stage, f"chunk-{chunk_name(index)}.json")

    def shard(self, name: str) -> str:
        return f"{self.root}/shards/{name}"

    def report(self, name: str, sha256: str) -> str:
        """Content-addressed (snapshots committed before were named report/<name>; readers
        take keys from the manifest, so both layouts load)."""
        return f"{self.root}/report/{sha256}/{name}"

    def final(self, name: str) -> str:
        return f"{self.root}/{name}"


def chunk_name(index: int) -> str:
    return f"{index:05d}"


class StageRecord(StoredRecord):
    """What a stage leaves behind: the files it wrote (key, size, sha256) and its figures.
    Each stage's record extends this in the module of the stage."""

    VERSION_FIELD: ClassVar[str] = "version"
    VERSIONS: ClassVar[tuple[Any, ...]] = (1,)
    WHAT: ClassVar[str] = "stage record"

    version: int = 1
    files: dict[str, StoredFile]

    @classmethod
    def _unversioned(cls) -> Any:
        return 1  # written by a worker from before the records named their version

    def dump_bytes(self) -> bytes:
        return json.dumps(self.dump(), indent=1, sort_keys=True).encode()


Record = TypeVar("Record", bound=StageRecord)


def done_record(store: ObjectStore, key: str, kind: type[Record]) -> Record | None:
    """The stage's record if it exists and every file it lists is there whole (as the store
    claims: the bytes are hashed when a later stage fetches them), else None."""
    try:
        raw = store.get_bytes(key)
    except ObjectNotFound:
        return None
    record = kind.parse(raw, key)
    try:
        check_claimed_files(store, record.files.values(), "stage file")
    except IntegrityError:
        return None
    return record


def required_record(store: ObjectStore, key: str, kind: type[Record], what: str) -> Record:
    """The record a later stage depends on; its absence means the stages ran out of order."""
    record = done_record(store, key, kind)
    if record is None:
        raise RuntimeError(f"{what} has not finished: {key} is missing or incomplete")
    return record


def file_entry(store: ObjectStore, key: str, path: Path) -> StoredFile:
    """Upload `path` to `key` and describe it for a record or manifest."""
    store.put_file(key, path)
    return StoredFile(key=key, bytes=path.stat().st_size, sha256=sha256_file(path))


def commit_record(store: ObjectStore, key: str, record: Record) -> Record:
    """Write the record last; if a concurrent attempt won the race, its record stands."""
    if store.put_if_absent(key, record.dump_bytes()):
        return record
    return type(record).parse(store.get_bytes(key), key)


def local_copy(store: ObjectStore, entry: StoredFile, cache: Path) -> Path:
    """A local path for a file of a record that `done_record` verified: the store's own file
    when the store is a local folder (no copy), else a download checked by sha256."""
    if isinstance(store, LocalStore):
        return store.root / entry.key
    dest = cache / entry.sha256
    return fetch_verified(store, entry.key, dest, entry.sha256, entry.bytes)
