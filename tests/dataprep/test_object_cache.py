"""Snapshots read from S3 objects (moto over HTTP): the same documents as the files, the version
that was planned or a clear failure, and each version fetched once."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import duckdb
import pytest

from dataprep.dataset_manifest import DatasetManifest
from dataprep.errors import BadRecordsError, SourceChangedError
from dataprep.filters import FilterSettings
from dataprep.plan import plan_snapshot
from dataprep.scan import SCAN
from dataprep.settings import SnapshotSettings
from dataprep.snapshot import prepare_snapshot, save_plan
from dataprep.stage_runner import run_stage
from infra.store.local import LocalStore

SPEECHES = SnapshotSettings(filters=FilterSettings(min_words=1), shard_tokens=20_000)


def _documents(store: LocalStore, manifest: DatasetManifest) -> list[tuple]:
    """The per-document report without the source column (a path here, a URL there)."""
    path = store.root / manifest.report["documents"].key
    return duckdb.sql(
        f"SELECT * EXCLUDE (source) FROM read_parquet('{path}') ORDER BY doc_id"
    ).fetchall()


def _shards(manifest: DatasetManifest) -> list[str]:
    return [s.sha256 for split in ("train", "val") for s in manifest.splits[split].shards]


@pytest.fixture
def docs(corpus: Path, tmp_path: Path) -> dict[str, bytes]:
    """Three formats: plain text, gzipped JSON lines (read by its .gz name) and code."""
    records = [{"text": f"record number {i} says something new"} for i in range(50)]
    return {
        "docs/corpus.txt": corpus.read_bytes(),
        "docs/records.jsonl.gz": gzip.compress(
            "".join(json.dumps(r) + "\n" for r in records).encode()
        ),
        "docs/tool.py": b"def main() -> None:\n    print('a tool')\n",
    }


def _write(root: Path, files: dict[str, bytes]) -> Path:
    for key, data in files.items():
        (root / key).parent.mkdir(parents=True, exist_ok=True)
        (root / key).write_bytes(data)
    return root


def _put(raw: Any, bucket: str, files: dict[str, bytes]) -> None:
    for key, data in files.items():
        raw.put_object(Bucket=bucket, Key=key, Body=data)


def test_a_snapshot_of_objects_holds_the_documents_of_the_same_files(
    raw: Any, bucket: str, docs: dict[str, bytes], tmp_path: Path
) -> None:
    _put(raw, bucket, docs)
    folder = _write(tmp_path / "local", docs) / "docs"
    store = LocalStore(tmp_path / "store")
    local = prepare_snapshot([str(folder)], SPEECHES, store, tmp_path / "local-work")
    remote = prepare_snapshot([f"s3://{bucket}/docs/"], SPEECHES, store, tmp_path / "s3-work")
    assert remote.snapshot_id != local.snapshot_id  # ETags name objects, sha256s name files
    rows = _documents(store, remote.manifest)
    assert rows == _documents(store, local.manifest)
    assert {row[2] for row in rows} == {"text", "code"} and len(rows) > 50
    # Same documents in the same order: the token shards are the same bytes.
    assert _shards(remote.manifest) == _shards(local.manifest)
    sources = remote.manifest.sources
    assert [s.path for s in sources] == [f"s3://{bucket}/{key}" for key in sorted(docs)]
    assert all(set(s.model_dump()) == {"path", "format", "bytes", "etag"} for s in sources)
    by_source = duckdb.sql(
        f"SELECT DISTINCT source FROM read_parquet('{store.root}/"
        f"{remote.manifest.report['documents'].key}') ORDER BY 1"
    ).fetchall()
    assert [s for (s,) in by_source] == [f"s3://{bucket}/{key}" for key in sorted(docs)]
    # One copy per object version, beside the work folder (a data worker's: see run_stage).
    copies = sorted(p.name for p in (tmp_path / "source-cache").rglob("object*"))
    assert copies == ["object.jsonl.gz", "object.py", "object.txt"]


def _planned_then(raw: Any, bucket: str, tmp_path: Path, change: Any) -> None:
    """Plan a snapshot of one object, let `change` act on the bucket, then scan it."""
    raw.put_object(Bucket=bucket, Key="docs/a.txt", Body=b"alpha beta gamma\n\ndelta\n")
    store = LocalStore(tmp_path / "store")
    plan = plan_snapshot([f"s3://{bucket}/docs/a.txt"], SPEECHES)
    save_plan(store, plan)
    change()
    run_stage(SCAN, store, plan, SPEECHES, tmp_path / "work", chunk=0)


def test_an_object_changed_after_planning_is_not_read_under_the_old_id(
    raw: Any, bucket: str, tmp_path: Path
) -> None:
    def replace() -> None:
        raw.put_object(Bucket=bucket, Key="docs/a.txt", Body=b"other words entirely\n")

    with pytest.raises(SourceChangedError) as failed:
        _planned_then(raw, bucket, tmp_path, replace)
    message = str(failed.value)
    assert f"source s3://{bucket}/docs/a.txt changed after this snapshot was planned" in message
    assert "forgeline data prepare" in message
    assert not list((tmp_path / "source-cache").rglob("object*"))  # nothing of it was kept


def test_an_object_deleted_after_planning_fails_naming_it(
    raw: Any, bucket: str, tmp_path: Path
) -> None:
    def delete() -> None:
        raw.delete_object(Bucket=bucket, Key="docs/a.txt")

    with pytest.raises(SourceChangedError, match=rf"s3://{bucket}/docs/a\.txt was deleted after"):
        _planned_then(raw, bucket, tmp_path, delete)


def test_a_version_is_fetched_once_and_read_from_the_cache_after(
    raw: Any, bucket: str, tmp_path: Path
) -> None:
    raw.put_object(Bucket=bucket, Key="docs/a.txt", Body=b"alpha beta gamma\n\ndelta\n")
    plan = plan_snapshot([f"s3://{bucket}/docs/a.txt"], SPEECHES)
    first = run_stage(
        SCAN, LocalStore(tmp_path / "one"), plan, SPEECHES, tmp_path / "work", lambda _: None, 0
    )
    # Gone from the bucket, but its copy is that version: a second reader needs no fetch.
    raw.delete_object(Bucket=bucket, Key="docs/a.txt")
    again = run_stage(
        SCAN, LocalStore(tmp_path / "two"), plan, SPEECHES, tmp_path / "work", lambda _: None, 0
    )
    assert again.documents == first.documents == 2


def test_a_bad_object_is_named_by_its_url_not_its_cached_copy(
    raw: Any, bucket: str, tmp_path: Path
) -> None:
    raw.put_object(Bucket=bucket, Key="docs/bad.jsonl", Body=b"{broken\n" * 20)
    with pytest.raises(BadRecordsError) as failed:
        prepare_snapshot(
            [f"s3://{bucket}/docs/bad.jsonl"], SPEECHES, LocalStore(tmp_path / "s"), tmp_path / "w"
        )
    assert str(failed.value).startswith(f"s3://{bucket}/docs/bad.jsonl: 20 of 20 records are bad")
    assert "source-cache" not in str(failed.value)


def test_the_scan_says_which_file_and_record_it_is_on(tmp_path: Path) -> None:
    """Its heartbeats: the workflow names the last one when a worker dies on a record
    (tests/workflows/test_dataset_workflow.py)."""
    corpus = tmp_path / "big.jsonl"
    lines = [{"text": "a short one"}, {"text": "word " * 300_000}, {"text": "after it"}]
    corpus.write_text("".join(json.dumps(line) + "\n" for line in lines))
    store = LocalStore(tmp_path / "store")
    plan = plan_snapshot([str(corpus)], SPEECHES)
    save_plan(store, plan)
    said: list[str] = []
    run_stage(SCAN, store, plan, SPEECHES, tmp_path / "work", said.append, chunk=0)
    assert said[0] == f"chunk 0: reading {corpus}"
    assert f"chunk 0: {corpus} record 2 (1,500,000 characters)" in said, said  # its line


def test_a_local_file_changed_after_planning_is_not_read_under_the_old_id(tmp_path: Path) -> None:
    """Before, the scan re-read the path: content swapped after planning (same size, so nothing
    else noticed) was committed under the clean content's snapshot id."""
    corpus = tmp_path / "a.txt"
    corpus.write_text("alpha beta gamma\n\ndelta\n")
    store = LocalStore(tmp_path / "store")
    plan = plan_snapshot([str(corpus)], SPEECHES)
    save_plan(store, plan)
    corpus.write_text("poison beta gamma\n\ndelta\n")  # as long as before
    with pytest.raises(SourceChangedError) as failed:
        run_stage(SCAN, store, plan, SPEECHES, tmp_path / "work", chunk=0)
    message = str(failed.value)
    assert f"source {corpus} changed after this snapshot was planned (sha256 " in message, message
    assert not any((tmp_path / "source-cache").rglob("*.txt"))  # its copy is gone
    corpus.write_text("alpha beta gamma\n\ndelta\n")  # as planned again: read, and named by path
    record = run_stage(SCAN, store, plan, SPEECHES, tmp_path / "work", chunk=0)
    assert record.documents == 2
    assert not any((tmp_path / "source-cache").rglob("*.txt"))
