"""Stage 1, per chunk: read → filter → normalize → exact hash, MinHash bands, split.

Writes three Parquet files for the chunk: `docs` (kept documents with their text), `bands`
(doc_id, band, hash: the LSH index rows) and `rejected` (what a filter removed and why), then
the done-record with the reading and filtering counts.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import BaseModel

from dataprep.documents import ReadStats
from dataprep.filters import build_filters, first_rejection
from dataprep.minhash import BandHasher
from dataprep.normalize import normalize
from dataprep.object_cache import SourceReader
from dataprep.stage_runner import Stage, StageRun, chunk_folder
from dataprep.stage_store import StageRecord, chunk_name

Progress = Callable[[str], None]

DOCS_SCHEMA = pa.schema(
    [
        ("doc_id", pa.int64()),
        ("source", pa.string()),
        ("position", pa.int64()),
        ("kind", pa.string()),
        ("language", pa.string()),
        ("chars", pa.int64()),
        ("exact_hash", pa.binary(16)),
        ("split", pa.string()),
        ("text", pa.string()),
    ]
)
BANDS_SCHEMA = pa.schema([("doc_id", pa.int64()), ("band", pa.int16()), ("hash", pa.int64())])
REJECTED_SCHEMA = pa.schema(
    [
        ("doc_id", pa.int64()),
        ("source", pa.string()),
        ("position", pa.int64()),
        ("kind", pa.string()),
        ("chars", pa.int64()),
        ("filter", pa.string()),
        ("detail", pa.string()),
        ("snippet", pa.string()),
    ]
)
_FLUSH = 2048
_SNIPPET = 200
_BIG_DOCUMENT_CHARS = 1 << 20  # announced in a heartbeat before it is filtered and hashed


class BadExample(BaseModel):
    source: str
    line: int  # where the record starts: 1-based line (JSONL, text), 0-based row (Parquet)
    reason: str


class ScanRecord(StageRecord):
    """One chunk read, filtered and hashed. Files: `docs` (kept documents with their exact
    hash and split), `bands` (MinHash band hashes), `rejected` (what a filter removed)."""

    chunk: int
    records: int
    documents: int
    kept: int
    bad: dict[str, int]  # bad records by reason
    bad_examples: list[BadExample]
    filtered: dict[str, int]  # documents removed, by filter


def split_of(exact_hash: bytes, val_fraction: float) -> str:
    """By content: a document (and every exact copy of it) always lands in the same split."""
    return "val" if int.from_bytes(exact_hash[:8], "big") / 2**64 < val_fraction else "train"


class _Table:
    """Rows buffered per column and written to Parquet in row groups."""

    def __init__(self, path: Path, schema: pa.Schema) -> None:
        self.path, self.schema = path, schema
        self.columns: dict[str, list] = {name: [] for name in schema.names}
        self.writer = pq.ParquetWriter(path, schema)
        self.rows = 0

    def add(self, **row: object) -> None:
        for name, value in row.items():
            self.columns[name].append(value)
        self.rows += 1
        if len(self.columns[self.schema.names[0]]) >= _FLUSH:
            self.flush()

    def extend(self, **columns: list) -> None:
        for name, values in columns.items():
            self.columns[name].extend(values)
        self.rows += len(next(iter(columns.values())))
        if len(self.columns[self.schema.names[0]]) >= _FLUSH:
            self.flush()

    def flush(self) -> None:
        if self.columns[self.schema.names[0]]:
            self.writer.write_table(pa.table(self.columns, schema=self.schema))
            self.columns = {name: [] for name in self.schema.names}

    def close(self) -> Path:
        self.flush()
        self.writer.close()
        return self.path


def _scan(run: StageRun) -> ScanRecord:
    """Read the chunk's files, filter, hash for exact and near dedup, assign splits."""
    assert run.chunk is not None
    index, settings, progress, keys = run.chunk, run.settings, run.progress, run.keys
    chunk = run.plan.chunks[index]
    folder = chunk_folder(run, "scan")
    docs = _Table(folder / "docs.parquet", DOCS_SCHEMA)
    bands = _Table(folder / "bands.parquet", BANDS_SCHEMA)
    rejected = _Table(folder / "rejected.parquet", REJECTED_SCHEMA)
    filters = build_filters(settings.filters)
    hasher = BandHasher(settings.dedup.minhash) if settings.dedup.near else None
    band_ids = np.arange(settings.dedup.minhash.bands, dtype=np.int16).tolist()
    stats = ReadStats()
    removed_by: Counter[str] = Counter()
    ordinal = 0
    sources = SourceReader(run.source_cache)
    for planned in chunk.files:
        progress(f"chunk {index}: reading {planned.path}")
        for doc in sources.documents(planned, settings.reader, stats):
            doc_id = chunk.doc_id(ordinal)
            ordinal += 1
            if len(doc.text) >= _BIG_DOCUMENT_CHARS:
                # Said before its work starts: if it is what kills the worker, the workflow's
                # last word on the chunk names it (its last heartbeat).
                progress(f"chunk {index}: {planned.path} record {doc.position} "
                         f"({len(doc.text):,} characters)")  # fmt: skip
            rejection = first_rejection(filters, doc)
            if rejection is not None:
                removed_by[rejection.filter] += 1
                rejected.add(
                    doc_id=doc_id,
                    source=doc.source,
                    position=doc.position,
                    kind=doc.kind,
                    chars=len(doc.text),
                    filter=rejection.filter,
                    detail=rejection.detail,
                    snippet=doc.text[:_SNIPPET],
                )
                continue
            normalized = normalize(doc.text)
            exact = hashlib.blake2b(normalized.encode(), digest_size=16).digest()
            docs.add(
                doc_id=doc_id,
                source=doc.source,
                position=doc.position,
                kind=doc.kind,
                language=doc.language,
                chars=len(doc.text),
                exact_hash=exact,
                split=split_of(exact, settings.val_fraction),
                text=doc.text,
            )
            if hasher is not None:
                hashes = hasher.bands(normalized).tolist()
                bands.extend(doc_id=[doc_id] * len(hashes), band=band_ids, hash=hashes)
            if ordinal % 5000 == 0:
                progress(f"chunk {index}: {ordinal} documents, at {planned.path} "
                         f"record {doc.position}")  # fmt: skip

    files = {
        name: run.upload(keys.work("scan", f"{name}-{chunk_name(index)}.parquet"), t.close())
        for name, t in (("docs", docs), ("bands", bands), ("rejected", rejected))
    }
    record = ScanRecord(
        chunk=index,
        records=stats.records,
        documents=stats.documents,
        kept=docs.rows,
        bad=dict(stats.bad),
        bad_examples=[BadExample(source=b.source, line=b.line, reason=b.reason)
                      for b in stats.examples],
        filtered=dict(removed_by),
        files=files,
    )  # fmt: skip
    progress(f"chunk {index}: {stats.documents} documents, {docs.rows} kept")
    return record


SCAN = Stage("scan", ScanRecord, _scan, per_chunk=True)
