"""The dataset snapshot's manifest, typed, and reading it checked against the sha256 a run was
given.

Written last by `dataprep.snapshot.commit_snapshot`, create-if-absent, as JSON with sorted
keys and no timestamp, so that two commits of one plan write the same bytes; a run carries the
manifest's sha256, and every reader checks it. The format string is the version
(`forgeline.dataset/2`).

Its own module, light on purpose: node agents read manifests on GPU hosts whose install has
no data-preparation packages (DuckDB, pyarrow, datasketch), which dataprep.snapshot imports.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict

from infra.digest import sha256_bytes
from infra.errors import IntegrityError
from infra.store.protocol import ObjectStore
from infra.stored_format import StoredFile, StoredRecord

MANIFEST_FORMAT = "forgeline.dataset/2"


class _Part(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)


class SourceFile(_Part):
    """A source the snapshot was read from, as it was when planned (sha256, or the ETag of an
    object in a bucket, beside the size)."""

    path: str
    format: str
    bytes: int


class DocumentCounts(_Part):
    records: int  # records in the sources (lines of JSONL, rows of Parquet, files of text)
    read: int  # documents read from them
    bad_records: int
    filtered: int
    exact_duplicates: int
    near_duplicates: int
    train: int  # documents kept, by split
    val: int


class Shard(StoredFile):
    tokens: int


class Split(_Part):
    documents: int
    tokens: int
    shards: list[Shard]


class TokenizerFile(StoredFile):
    kind: str  # "bpe" or "char"
    vocab_size: int
    end_of_document_id: int


class DatasetManifest(StoredRecord):
    VERSIONS: ClassVar[tuple[Any, ...]] = (MANIFEST_FORMAT,)
    WHAT: ClassVar[str] = "dataset manifest"

    format: str = MANIFEST_FORMAT
    snapshot_id: str
    dataprep_version: int
    settings: dict[str, Any]  # what the snapshot id hashes, besides the sources
    sources: list[SourceFile]
    documents: DocumentCounts
    tokenizer: TokenizerFile
    dtype: str  # of the token shards: uint16 or uint32
    splits: dict[str, Split]  # "train" and "val"
    report: dict[str, StoredFile]  # "documents" (Parquet) and "summary" (JSON)

    def files(self) -> list[StoredFile]:
        """Every file the snapshot is made of: token shards, tokenizer, report."""
        shards = [shard for split in self.splits.values() for shard in split.shards]
        return [*shards, self.tokenizer, *self.report.values()]

    def dump_bytes(self) -> bytes:
        # The bytes the snapshot's sha256 is taken over: sorted keys, one-space indent.
        return json.dumps(self.dump(), indent=1, sort_keys=True).encode()


def load_manifest(store: ObjectStore, key: str, sha256: str) -> DatasetManifest:
    """Read a dataset manifest and check it is the one the run was given."""
    data = store.get_bytes(key)
    actual = sha256_bytes(data)
    if actual != sha256:
        raise IntegrityError(
            f"dataset manifest {key} has sha256 {actual[:12]}…, expected {sha256[:12]}…: "
            "the snapshot was modified after the run started"
        )
    return DatasetManifest.parse(data, key)
