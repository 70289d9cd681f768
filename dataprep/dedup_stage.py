"""Stage 2, once over the whole snapshot: exact dedup, then MinHash near-dedup, in DuckDB."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from dataprep.errors import EmptyCorpusError
from dataprep.near_dedup import (
    candidate_pairs,
    cluster_pairs,
    exact_duplicates,
    jaccard,
    verify_pairs,
)
from dataprep.scan import ScanRecord
from dataprep.stage_runner import Needs, Stage, StageRun
from dataprep.stage_store import StageRecord

Progress = Callable[[str], None]
REMOVED_SCHEMA = pa.schema([("doc_id", pa.int64()), ("kept", pa.int64())])
_EXAMPLES = 5
_SNIPPET = 300


class DedupRecord(StageRecord):
    """The whole snapshot deduplicated. Files: `removed` (each removed document and the one
    kept in its place, with the reason: exact or near)."""

    exact_removed: int
    candidate_pairs: int
    verified_pairs: int | None  # None: pairs were not verified (dedup.verify = false)
    near_clusters: int
    near_removed: int
    examples: list[dict[str, Any]]  # a few near-duplicate pairs with snippets, for the report


# What the stages after a stage read of it.
NEEDS_EVERY_SCAN = Needs("scan", ScanRecord, "scan", every_chunk=True)
NEEDS_DEDUP = Needs("dedup", DedupRecord, "deduplication")


def _dedup(run: StageRun) -> DedupRecord:
    """Exact duplicates by hash, then near duplicates: MinHash band candidates, verified by
    Jaccard, clustered; one document of each cluster is kept."""
    scans = run.records("scan", ScanRecord)
    docs = [run.local(r.files["docs"]) for r in scans]
    bands = [run.local(r.files["bands"]) for r in scans]
    folder = run.folder("dedup")
    dedup, progress = run.settings.dedup, run.progress
    con = run.duckdb()

    exact = folder / "exact.parquet"
    exact_removed = exact_duplicates(con, docs, exact) if dedup.exact else _empty(exact)
    progress(f"exact dedup: {exact_removed} duplicates")

    near = folder / "near.parquet"
    candidates = verified = clusters = 0
    if dedup.near:
        edges = folder / "candidates.parquet"
        candidates = candidate_pairs(con, bands, exact, edges)
        progress(f"near dedup: {candidates} candidate pairs")
        if dedup.verify:
            checked = folder / "verified.parquet"
            verified = verify_pairs(con, edges, docs, dedup.minhash.ngram, dedup.threshold, checked)
            edges = checked
            progress(f"near dedup: {verified} pairs verified ≥ {dedup.threshold}")
        found = cluster_pairs(edges, near)
        clusters, near_removed = found.clusters, found.removed
    else:
        near_removed = _empty(near)
    progress(f"near dedup: {near_removed} documents removed in {clusters} clusters")

    removed = folder / "removed.parquet"
    con.execute(
        f"""
        COPY (
            SELECT doc_id, kept, 'exact' AS reason FROM read_parquet('{exact}')
            UNION ALL
            SELECT doc_id, kept, 'near' AS reason FROM read_parquet('{near}')
        ) TO '{removed}' (FORMAT parquet)
        """
    )
    _refuse_empty(scans, exact_removed + near_removed)
    examples = _examples(con, near, docs, dedup.minhash.ngram)
    record = DedupRecord(
        exact_removed=exact_removed,
        candidate_pairs=candidates,
        verified_pairs=verified if dedup.verify else None,
        near_clusters=clusters,
        near_removed=near_removed,
        examples=examples,
        files={"removed": run.upload(run.keys.work("dedup", "removed.parquet"), removed)},
    )
    return record


DEDUP = Stage("dedup", DedupRecord, _dedup, needs=(NEEDS_EVERY_SCAN,))


def _refuse_empty(scans: list[ScanRecord], duplicates: int) -> None:
    """Stop before tokenizer training when nothing is left to train on, saying why."""
    read = sum(r.documents for r in scans)
    if read == 0:
        bad = sum(sum(r.bad.values()) for r in scans)
        raise EmptyCorpusError(
            f"no documents were read ({bad} bad records): check the files, data.split and "
            "data.text_field"
        )
    if sum(r.kept for r in scans) - duplicates <= 0:
        filtered = sum(sum(r.filtered.values()) for r in scans)
        raise EmptyCorpusError(
            f"every document was removed ({filtered} of {read} by filters, {duplicates} as "
            "duplicates): loosen [data.filters]; `forgeline data report` shows which filter "
            "removed what"
        )


def _empty(path: Path) -> int:
    pq.write_table(pa.table({"doc_id": [], "kept": []}, schema=REMOVED_SCHEMA), path)
    return 0


def _examples(con, near: Path, docs: list[Path], ngram: int) -> list[dict]:
    """A few near-duplicate pairs, with snippets and their exact Jaccard, for the report."""
    files = "[" + ", ".join(f"'{p}'" for p in docs) + "]"
    rows = con.execute(
        f"""
        WITH texts AS (SELECT doc_id, source, text FROM read_parquet({files}))
        SELECT r.doc_id, r.kept, a.source, a.text, b.source, b.text
        FROM (SELECT * FROM read_parquet('{near}') ORDER BY doc_id LIMIT {_EXAMPLES}) r
        JOIN texts a ON a.doc_id = r.doc_id JOIN texts b ON b.doc_id = r.kept
        ORDER BY r.doc_id
        """
    ).fetchall()
    return [
        {
            "removed": {"doc_id": doc_id, "source": source, "snippet": text[:_SNIPPET]},
            "kept": {"doc_id": kept, "source": kept_source, "snippet": kept_text[:_SNIPPET]},
            "jaccard": round(jaccard(text, kept_text, ngram), 4),
        }
        for doc_id, kept, source, text, kept_source, kept_text in rows
    ]
