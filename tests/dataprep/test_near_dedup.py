from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dataprep.near_dedup import (
    UnionFind,
    candidate_pairs,
    cluster_pairs,
    connect,
    exact_duplicates,
    jaccard,
    verify_pairs,
)


def write(path: Path, **columns: list) -> Path:
    pq.write_table(pa.table(columns), path)
    return path


def rows(path: Path) -> list[tuple]:
    table = pq.read_table(path)
    return sorted(zip(*(table.column(c).to_pylist() for c in table.column_names), strict=True))


def test_union_find_roots_are_the_smallest_ids() -> None:
    sets = UnionFind()
    for a, b in [(5, 9), (9, 2), (7, 8), (8, 5), (100, 101)]:
        sets.union(a, b)
    assert {x: sets.find(x) for x in (2, 5, 7, 8, 9)} == dict.fromkeys((2, 5, 7, 8, 9), 2)
    assert sets.find(101) == 100 and sets.find(42) == 42


def test_exact_candidates_clusters(tmp_path: Path) -> None:
    con = connect("64MB", tmp_path / "spill")
    docs = write(
        tmp_path / "docs.parquet",
        doc_id=[1, 2, 3, 4, 5],
        exact_hash=[b"a" * 16, b"b" * 16, b"a" * 16, b"c" * 16, b"a" * 16],
        text=["x", "y", "x", "z", "x"],
    )
    exact = tmp_path / "exact.parquet"
    assert exact_duplicates(con, [docs], exact) == 2
    assert rows(exact) == [(3, 1), (5, 1)]

    # Bands: 10 and 11 share band 0; 11 and 12 share band 1; 3 (an exact copy) shares with 10.
    bands = write(
        tmp_path / "bands.parquet",
        doc_id=[10, 10, 11, 11, 12, 12, 3, 3, 13, 13],
        band=[0, 1, 0, 1, 0, 1, 0, 1, 0, 1],
        hash=[7, 8, 7, 9, 6, 9, 7, 1, 2, 3],
    )
    edges = tmp_path / "edges.parquet"
    assert candidate_pairs(con, [bands], exact, edges) == 2
    assert rows(edges) == [(11, 10), (12, 11)]  # doc 3 is excluded: exact dedup removed it
    clustered = tmp_path / "near.parquet"
    found = cluster_pairs(edges, clustered)
    assert (found.clusters, found.removed) == (1, 2)
    assert rows(clustered) == [(11, 10), (12, 10)]  # the earliest document is kept


def test_verification_drops_dissimilar_candidates(tmp_path: Path) -> None:
    con = connect("64MB", tmp_path / "spill")
    base = " ".join(f"w{i}" for i in range(100))
    close = base.replace("w50", "changed")
    far = " ".join(f"v{i}" for i in range(100))
    docs = write(tmp_path / "docs.parquet", doc_id=[1, 2, 3], text=[base, close, far])
    edges = write(tmp_path / "edges.parquet", doc_id=[2, 3], anchor=[1, 1])
    out = tmp_path / "verified.parquet"
    assert verify_pairs(con, edges, [docs], 5, 0.8, out) == 1
    (kept,) = rows(out)
    assert kept[:2] == (2, 1) and kept[2] == pytest.approx(jaccard(base, close, 5))
    assert jaccard(base, close, 5) == pytest.approx(91 / 101)


def test_band_index_larger_than_the_memory_limit(tmp_path: Path) -> None:
    """DuckDB spills the group-by to disk instead of failing when the index outgrows RAM."""
    count, bands = 400_000, 8
    doc_ids = [d for d in range(count) for _ in range(bands)]
    band = list(range(bands)) * count
    # Unique hashes, except that every 1000th document copies its predecessor's band 0.
    hashes = [d * bands + b for d in range(count) for b in range(bands)]
    for d in range(1000, count, 1000):
        hashes[d * bands] = (d - 1) * bands
    index = write(tmp_path / "bands.parquet", doc_id=doc_ids, band=band, hash=hashes)
    exclude = write(tmp_path / "none.parquet", doc_id=pa.array([], pa.int64()))
    # 3.2 M index rows are 58 MB of raw columns alone (8 + 2 + 8 bytes each), and DuckDB's
    # hash table for them several times that: a 50 MB budget forces the group-by to spill.
    con = connect("50MB", tmp_path / "spill")
    out = tmp_path / "edges.parquet"
    assert candidate_pairs(con, [index], exclude, out) == count // 1000 - 1
    assert rows(out)[0] == (1000, 999)
