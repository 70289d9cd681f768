"""The snapshot's report: one row per document read (its fate and why), and a summary.

`documents.parquet` is the evidence (source, kind, split, status: kept / filtered / exact / near,
the filter or the document it duplicates, tokens); `summarize` answers the usual questions
with DuckDB over it, the same queries for `forgeline data report` and for `report.json`.
"""

from __future__ import annotations

from pathlib import Path

import duckdb


def _files(paths: list[Path]) -> str:
    return "[" + ", ".join(f"'{p}'" for p in paths) + "]"


def build_documents_table(
    con: duckdb.DuckDBPyConnection,
    docs: list[Path],
    rejected: list[Path],
    removed: Path,
    tokens: list[Path],
    out: Path,
) -> Path:
    con.execute(
        f"""
        COPY (
            SELECT d.doc_id, d.source, d.position, d.kind, d.language, d.chars, d.split,
                   coalesce(r.reason, 'kept') AS status, r.kept AS duplicate_of,
                   NULL::VARCHAR AS filter, t.tokens
            FROM read_parquet({_files(docs)}) d
            LEFT JOIN read_parquet('{removed}') r USING (doc_id)
            LEFT JOIN read_parquet({_files(tokens)}) t USING (doc_id)
            UNION ALL
            SELECT doc_id, source, position, kind, NULL, chars, NULL,
                   'filtered', NULL, filter, NULL
            FROM read_parquet({_files(rejected)})
            ORDER BY doc_id
        ) TO '{out}' (FORMAT parquet)
        """
    )
    return out


def summarize(con: duckdb.DuckDBPyConnection, documents: Path) -> dict:
    table = f"read_parquet('{documents}')"

    def rows(sql: str) -> list[dict]:
        cursor = con.execute(sql)
        names = [c[0] for c in cursor.description]
        return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]

    return {
        "by_source": rows(
            f"""
            SELECT source, count(*) AS documents,
                   count(*) FILTER (status = 'kept') AS kept,
                   count(*) FILTER (status = 'filtered') AS filtered,
                   count(*) FILTER (status = 'exact') AS exact_duplicates,
                   count(*) FILTER (status = 'near') AS near_duplicates,
                   coalesce(sum(tokens), 0)::BIGINT AS tokens
            FROM {table} GROUP BY source ORDER BY source
            """
        ),
        "by_filter": rows(
            f"""
            SELECT filter, count(*) AS documents, sum(chars)::BIGINT AS chars
            FROM {table} WHERE status = 'filtered' GROUP BY filter ORDER BY documents DESC, filter
            """
        ),
        "by_dedup": rows(
            f"""
            SELECT status AS kind, count(*) AS removed, count(DISTINCT duplicate_of) AS clusters
            FROM {table} WHERE status IN ('exact', 'near') GROUP BY status ORDER BY status
            """
        ),
        "by_split": rows(
            f"""
            SELECT split, count(*) AS documents, sum(tokens)::BIGINT AS tokens
            FROM {table} WHERE status = 'kept' GROUP BY split ORDER BY split
            """
        ),
        "by_kind": rows(
            f"""
            SELECT kind, coalesce(language, '') AS language, count(*) AS documents,
                   count(*) FILTER (status = 'kept') AS kept
            FROM {table} GROUP BY kind, language ORDER BY kind, language
            """
        ),
    }
