"""Deduplication over the band index with DuckDB, so no index has to fit in memory.

Inputs are Parquet files written by the scan stage: `bands` rows (doc_id, band, hash) and
`docs` rows (doc_id, exact_hash, text, ...). DuckDB's hash aggregate and join spill to disk
under `memory_limit`, which is what lets the index outgrow RAM. Candidate pairs come out as
(doc_id, anchor) edges: every member of a band bucket points at the bucket's smallest doc_id,
which keeps the pair count linear in the bucket size and preserves connectivity. Union-find
over the edges gives clusters; the smallest doc_id of a cluster (the earliest document in
source order) is kept.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from dataprep.minhash import shingle_hashes
from dataprep.normalize import normalize

_BATCH = 65_536


def connect(memory_limit: str, temp_dir: Path, threads: int = 2) -> duckdb.DuckDBPyConnection:
    temp_dir.mkdir(parents=True, exist_ok=True)
    con = duckdb.connect()
    con.execute(f"SET memory_limit = '{memory_limit}'")
    con.execute(f"SET temp_directory = '{temp_dir}'")
    con.execute(f"SET threads = {int(threads)}")
    con.execute("SET preserve_insertion_order = false")  # lets big sorts and copies stream
    con.execute("SET enable_progress_bar = false")  # workers log; a terminal bar is noise there
    return con


def _files(paths: Sequence[Path]) -> str:
    return "[" + ", ".join(f"'{p}'" for p in paths) + "]"


def exact_duplicates(con: duckdb.DuckDBPyConnection, docs: Sequence[Path], out: Path) -> int:
    """(doc_id, kept) for every document whose normalized text an earlier document has."""
    con.sql(
        f"""
        COPY (
            WITH docs AS (SELECT doc_id, exact_hash FROM read_parquet({_files(docs)})),
                 groups AS (
                     SELECT exact_hash, min(doc_id) AS kept FROM docs
                     GROUP BY exact_hash HAVING count(*) > 1
                 )
            SELECT d.doc_id, g.kept FROM docs d JOIN groups g USING (exact_hash)
            WHERE d.doc_id <> g.kept
        ) TO '{out}' (FORMAT parquet)
        """
    )
    return _rows(out)


def candidate_pairs(
    con: duckdb.DuckDBPyConnection, bands: Sequence[Path], exclude: Path, out: Path
) -> int:
    """Edges (doc_id, anchor) between documents that share at least one band bucket.

    Documents listed in `exclude` (exact duplicates, already removed) take no part.
    """
    con.execute(
        f"""
        COPY (
            WITH bands AS (
                     SELECT b.doc_id, b.band, b.hash FROM read_parquet({_files(bands)}) b
                     ANTI JOIN read_parquet('{exclude}') x ON b.doc_id = x.doc_id
                 ),
                 buckets AS (
                     SELECT band, hash, min(doc_id) AS anchor FROM bands
                     GROUP BY band, hash HAVING count(*) > 1
                 )
            SELECT DISTINCT b.doc_id, k.anchor FROM bands b JOIN buckets k USING (band, hash)
            WHERE b.doc_id <> k.anchor
        ) TO '{out}' (FORMAT parquet)
        """
    )
    return _rows(out)


def verify_pairs(
    con: duckdb.DuckDBPyConnection,
    pairs: Path,
    docs: Sequence[Path],
    ngram: int,
    threshold: float,
    out: Path,
) -> int:
    """Keep the candidate edges whose exact Jaccard similarity of shingles is ≥ threshold."""
    reader = con.sql(
        f"""
        WITH texts AS (SELECT doc_id, text FROM read_parquet({_files(docs)}))
        SELECT p.doc_id, p.anchor, a.text AS text, b.text AS anchor_text
        FROM read_parquet('{pairs}') p
        JOIN texts a ON a.doc_id = p.doc_id
        JOIN texts b ON b.doc_id = p.anchor
        """
    ).to_arrow_reader(_BATCH)
    schema = pa.schema([("doc_id", pa.int64()), ("anchor", pa.int64()), ("jaccard", pa.float32())])
    kept = 0
    with pq.ParquetWriter(out, schema) as writer:
        for batch in reader:
            rows = batch.to_pydict()
            keep_ids, keep_anchors, scores = [], [], []
            for doc_id, anchor, text, anchor_text in zip(
                rows["doc_id"], rows["anchor"], rows["text"], rows["anchor_text"], strict=True
            ):
                score = jaccard(text, anchor_text, ngram)
                if score >= threshold:
                    keep_ids.append(doc_id)
                    keep_anchors.append(anchor)
                    scores.append(score)
            kept += len(keep_ids)
            writer.write_table(pa.table([keep_ids, keep_anchors, scores], schema=schema))
    return kept


def jaccard(a: str, b: str, ngram: int) -> float:
    """Jaccard similarity of the two documents' shingle sets (by 32-bit shingle hash)."""
    sa = np.unique(shingle_hashes(normalize(a), ngram))
    sb = np.unique(shingle_hashes(normalize(b), ngram))
    union = len(np.union1d(sa, sb))
    return len(np.intersect1d(sa, sb, assume_unique=True)) / union if union else 1.0


class UnionFind:
    """Disjoint sets over doc ids; a root is always its set's smallest id."""

    def __init__(self) -> None:
        self.parent: dict[int, int] = {}

    def find(self, x: int) -> int:
        parent = self.parent
        root = x
        while parent.get(root, root) != root:
            root = parent[root]
        while x != root:  # path compression
            parent[x], x = root, parent[x]
        return root

    def union(self, a: int, b: int) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            small, large = (ra, rb) if ra < rb else (rb, ra)
            self.parent[large] = small
            self.parent.setdefault(small, small)


@dataclass(frozen=True)
class Clusters:
    clusters: int  # clusters with more than one document
    removed: int


def cluster_pairs(pairs: Path, out: Path) -> Clusters:
    """Union-find over the edges; writes (doc_id, kept) for every document to remove."""
    sets = UnionFind()
    for doc_ids, anchors in _edges(pairs):
        for a, b in zip(doc_ids, anchors, strict=True):
            sets.union(a, b)
    members = np.fromiter(sets.parent.keys(), dtype=np.int64, count=len(sets.parent))
    roots = np.fromiter((sets.find(int(m)) for m in members), dtype=np.int64, count=len(members))
    removed = members != roots
    pq.write_table(pa.table({"doc_id": members[removed], "kept": roots[removed]}), out)
    return Clusters(clusters=int(np.unique(roots).size), removed=int(removed.sum()))


def _edges(path: Path) -> Iterator[tuple[list[int], list[int]]]:
    for batch in pq.ParquetFile(path).iter_batches(_BATCH, columns=["doc_id", "anchor"]):
        yield batch.column(0).to_pylist(), batch.column(1).to_pylist()


def _rows(path: Path) -> int:
    return pq.ParquetFile(path).metadata.num_rows
