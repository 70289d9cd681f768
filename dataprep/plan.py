"""Plan a snapshot: expand the sources, hash them, name the snapshot, cut the work into chunks.

A chunk is a run of source files (in their sorted order) of about `chunk_bytes`; a file larger
than that is a chunk of its own. Chunks are the unit that stages fan out over and that a retry
skips when done. A document's id is (chunk << 32 | ordinal in chunk), so ids follow source
order, and "keep the smallest id" keeps the earliest copy of a duplicate.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from dataprep.errors import SourceError
from dataprep.remote_sources import ObjectSource, expand_objects, split_sources
from dataprep.settings import SnapshotSettings
from dataprep.source_roots import UNCONFINED, DataRoots
from dataprep.source_urls import S3_SCHEME
from dataprep.sources import SourceFile, expand_sources
from infra.digest import sha256_file

# Bump when the same input and settings would produce different bytes: old snapshots then stop
# matching instead of being reused with a stale layout.
DATAPREP_VERSION = 2
# Each chunk costs a few events in the dataset workflow's history (limit 51,200 events), so a
# huge corpus gets bigger chunks instead of more of them.
MAX_CHUNKS = 1024


@dataclass(frozen=True)
class PlannedFile:
    path: str  # an absolute local path, or an object's URL (s3://bucket/key)
    format: str
    language: str | None
    bytes: int
    sha256: str  # local files; "" for objects, which are not read to be planned
    # Objects only (defaults, so plans written before objects existed still load): the ETag
    # that was listed, which names the version in the snapshot id and pins its read, and the
    # options of the URL it was found through (endpoint=…&profile=…), to reach the same site.
    etag: str = ""
    options: str = ""

    @property
    def is_object(self) -> bool:
        return self.path.startswith(S3_SCHEME)

    def source(self) -> SourceFile:
        return SourceFile(self.path, self.format, self.language)  # type: ignore[arg-type]

    def identity(self) -> str:
        """This file's part of the snapshot id: its content, never its name or place."""
        if self.is_object:
            # Size and ETag: the ETag changes with the content (a single-part upload's is its
            # MD5, a multipart one's the MD5 of its parts' MD5s), and hashing a remote corpus
            # would mean downloading all of it on the one worker that plans.
            return f"{self.format}:{self.language}:s3:{self.bytes}:{self.etag}\n"
        return f"{self.format}:{self.language}:{self.sha256}\n"  # unchanged: old ids hold

    def manifest_entry(self) -> dict:
        version = {"etag": self.etag} if self.is_object else {"sha256": self.sha256}
        return {"path": self.path, "format": self.format, "bytes": self.bytes, **version}


@dataclass(frozen=True)
class Chunk:
    index: int
    files: list[PlannedFile]

    def doc_id(self, ordinal: int) -> int:
        return (self.index << 32) | ordinal


@dataclass(frozen=True)
class SnapshotPlan:
    snapshot_id: str
    identity: dict  # the settings that name the snapshot
    chunks: list[Chunk]

    @property
    def files(self) -> list[PlannedFile]:
        return [f for chunk in self.chunks for f in chunk.files]

    @property
    def named_by_its_content(self) -> bool:
        """Whether its settings and files hash to its id: a plan read back from the store is
        this snapshot's, not one that someone who can write the store put under its key."""
        return snapshot_id_of(self.identity, self.files) == self.snapshot_id

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), indent=1, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> SnapshotPlan:
        raw = json.loads(data)
        chunks = [Chunk(c["index"], [PlannedFile(**f) for f in c["files"]]) for c in raw["chunks"]]
        return cls(raw["snapshot_id"], raw["identity"], chunks)


def plan_snapshot(
    patterns: list[str],
    settings: SnapshotSettings,
    store_url: str = "",
    roots: DataRoots = UNCONFINED,
) -> SnapshotPlan:
    """`store_url`: the store that `store:` sources name (the run's, as this process has it).
    `roots`: the folders local sources must lie in, links resolved (a data worker's)."""
    local, remote = split_sources(patterns, store_url)
    files = [_planned(s) for s in roots.check(expand_sources(local))] if local else []
    files += [_planned_object(o) for o in expand_objects(remote)]
    files.sort(key=lambda f: (f.path, f.options))  # local paths ("/…") sort before URLs
    identity = {"dataprep_version": DATAPREP_VERSION, **settings.identity()}
    total = sum(f.bytes for f in files)
    chunk_bytes = max(settings.chunk_bytes, -(-total // MAX_CHUNKS))
    return SnapshotPlan(snapshot_id_of(identity, files), identity, _chunk(files, chunk_bytes))


def snapshot_id_of(identity: dict, files: list[PlannedFile]) -> str:
    """The id of a snapshot of `files` (in their order) prepared with the settings `identity`.
    Contents and order name the snapshot, not paths: moving a corpus does not rebuild it."""
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode())
    for f in files:
        digest.update(f.identity().encode())
    return digest.hexdigest()[:20]


def _planned(source: SourceFile) -> PlannedFile:
    path = Path(source.path)
    try:
        size, digest = path.stat().st_size, sha256_file(path)
    except OSError as err:  # unreadable, or gone since the sources were listed
        raise SourceError(
            f"source {source.path} cannot be read ({err.strerror or err}): fix it or remove it "
            "from data.sources"
        ) from None
    return PlannedFile(source.path, source.format, source.language, size, digest)


def _planned_object(found: ObjectSource) -> PlannedFile:
    source = found.source
    return PlannedFile(
        source.path, source.format, source.language, found.size, "", found.etag, found.options
    )


def _chunk(files: list[PlannedFile], chunk_bytes: int) -> list[Chunk]:
    chunks: list[Chunk] = []
    current: list[PlannedFile] = []
    size = 0
    for f in files:
        if current and size + f.bytes > chunk_bytes:
            chunks.append(Chunk(len(chunks), current))
            current, size = [], 0
        current.append(f)
        size += f.bytes
    if current:
        chunks.append(Chunk(len(chunks), current))
    return chunks
