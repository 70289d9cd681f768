"""s3:// and store: sources, expanded and planned against a real S3 server (moto over HTTP)."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest

from dataprep.errors import SourceError
from dataprep.plan import plan_snapshot
from dataprep.remote_sources import expand_objects, split_sources
from dataprep.settings import SnapshotSettings
from dataprep.sources import expand_sources

TREE = {
    "corpus/a.txt": "alpha",
    "corpus/b.md": "beta",
    "corpus/part-1.jsonl": '{"text": "one"}\n',
    "corpus/part-2.jsonl": '{"text": "two"}\n',
    "corpus/part-10.jsonl": '{"text": "ten"}\n',
    "corpus/table.csv": "not,a,corpus",
    "corpus/sub/c.txt": "gamma",
    "corpus/sub/deep/d.jsonl.gz": "",
    "corpus/sub/.e.txt": "hidden file",
    "corpus/.hidden/f.txt": "hidden folder",
    "corpus/node_modules/g.js": "tool folder",
    "corpus/code/m.py": "print(1)\n",
    "other/z.txt": "zeta",
}


def _upload(raw: Any, bucket: str, files: dict[str, str | bytes], under: str = "") -> None:
    for key, body in files.items():
        data = body.encode() if isinstance(body, str) else body
        raw.put_object(Bucket=bucket, Key=f"{under}{key}", Body=data)


def _objects(patterns: list[str], store_url: str = "") -> list[str]:
    local, remote = split_sources(patterns, store_url)
    assert not local
    return [o.source.path for o in expand_objects(remote)]


@pytest.mark.parametrize(
    "pattern",
    [
        "corpus",
        "corpus/",
        "corpus/code/m.py",
        "corpus/*.jsonl",
        "corpus/part-?.jsonl",
        "corpus/[ab].*",
        "corpus/s*",
        "corpus/**/*.txt",
        "corpus/**",
        "corpus/sub/**",
        "corpus/.hidden/*.txt",
        "*/*.txt",
        "**/*.py",
    ],
)
def test_keys_match_as_the_same_files_do_locally(
    raw: Any, bucket: str, tmp_path: Path, pattern: str
) -> None:
    _upload(raw, bucket, TREE)
    for key, body in TREE.items():
        (tmp_path / key).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / key).write_text(body)
    local = [
        Path(s.path).relative_to(tmp_path).as_posix()
        for s in expand_sources([f"{tmp_path}/{pattern}"])
    ]
    remote = [url.removeprefix(f"s3://{bucket}/") for url in _objects([f"s3://{bucket}/{pattern}"])]
    assert remote == local
    assert local  # every pattern names something: the comparison is not of two empty lists


def test_a_prefix_and_a_glob_name_typed_objects(raw: Any, bucket: str) -> None:
    _upload(raw, bucket, TREE)
    _, remote = split_sources([f"s3://{bucket}/corpus/sub/"], "")
    found = {o.source.path: (o.source.format, o.size) for o in expand_objects(remote)}
    assert found == {
        f"s3://{bucket}/corpus/sub/c.txt": ("text", 5),
        f"s3://{bucket}/corpus/sub/deep/d.jsonl.gz": ("jsonl", 0),
    }
    # Two patterns naming one object name it once; the result is sorted by URL.
    assert _objects([f"s3://{bucket}/corpus/*.md", f"s3://{bucket}/corpus/[b]*"]) == [
        f"s3://{bucket}/corpus/b.md"
    ]


@pytest.mark.parametrize(
    ("pattern", "message"),
    [
        ("corpus/nothing/", r"source pattern s3://{b}/corpus/nothing/ matches no objects"),
        ("corpus/*.csv", r"matches no objects \(1 objects with unknown extensions were skipped"),
        ("corpus/table.csv", r"source s3://{b}/corpus/table\.csv has an unknown extension"),
    ],
)
def test_sources_that_name_no_object_are_named(
    raw: Any, bucket: str, pattern: str, message: str
) -> None:
    _upload(raw, bucket, TREE)
    with pytest.raises(SourceError, match=message.format(b=bucket)):
        _objects([f"s3://{bucket}/{pattern}"])


def test_a_missing_bucket_is_a_source_error(endpoint: str) -> None:
    with pytest.raises(SourceError, match=r"s3://forgeline-nowhere/x/ cannot be listed.*not exist"):
        _objects(["s3://forgeline-nowhere/x/"])


@pytest.mark.parametrize(
    "source",
    [
        "s3://AKIAEXAMPLE:hunter2-secret-key@bucket/corpus/",
        "s3://hunter2-secret-key@bucket/corpus/",
        "s3://bucket/corpus/?endpoint=http://user:hunter2-secret-key@127.0.0.1:9000",
    ],
)
def test_credentials_in_a_source_url_are_refused(source: str) -> None:
    with pytest.raises(SourceError) as refused:
        plan_snapshot([source], SnapshotSettings())
    message = str(refused.value)
    assert "hunter2-secret-key" not in message
    assert "carries credentials" in message and "data.sources" in message
    assert "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY" in message and "?profile=NAME" in message


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("s3:///corpus/", "has no valid bucket"),
        ("s3://bucket/x?endpoints=http://h", r"options \['endpoints'\] are not valid"),
        ("store:", "is not a key of the run's store"),
        ("store:../elsewhere", "is not a key of the run's store"),
    ],
)
def test_malformed_object_sources_are_refused(source: str, message: str) -> None:
    with pytest.raises(SourceError, match=message):
        plan_snapshot([source], SnapshotSettings(), "s3://bucket")


def test_an_object_changed_changes_the_snapshot_id_and_nothing_changed_keeps_it(
    raw: Any, bucket: str
) -> None:
    _upload(raw, bucket, {"a.txt": "alpha beta", "b.txt": "gamma delta"}, under="docs/")
    sources = [f"s3://{bucket}/docs/"]
    first = plan_snapshot(sources, SnapshotSettings())
    assert plan_snapshot(sources, SnapshotSettings()).snapshot_id == first.snapshot_id
    _upload(raw, bucket, {"b.txt": "gamma delta!"}, under="docs/")
    changed = plan_snapshot(sources, SnapshotSettings())
    assert changed.snapshot_id != first.snapshot_id
    # The same bytes again: a single-part upload's ETag is their MD5, so the id comes back.
    _upload(raw, bucket, {"b.txt": "gamma delta"}, under="docs/")
    assert plan_snapshot(sources, SnapshotSettings()).snapshot_id == first.snapshot_id
    # Where the objects are is no part of the id (as for local files): only their versions.
    _upload(raw, bucket, {"a.txt": "alpha beta", "b.txt": "gamma delta"}, under="moved/")
    moved = plan_snapshot([f"s3://{bucket}/moved/"], SnapshotSettings())
    assert moved.snapshot_id == first.snapshot_id
    entry = first.files[0]
    assert (entry.path, entry.bytes, entry.sha256) == (f"s3://{bucket}/docs/a.txt", 10, "")
    assert entry.etag.strip('"') == hashlib.md5(b"alpha beta").hexdigest()


def test_store_sources_name_objects_of_the_runs_store(
    raw: Any, bucket: str, endpoint: str, tmp_path: Path
) -> None:
    _upload(raw, bucket, {"corpus/a.txt": "alpha", "corpus/b.jsonl": "{}\n"}, under="store/")
    # The store URL's options (where it is) carry over to the objects found through it.
    store_url = f"s3://{bucket}/store?endpoint={endpoint}"
    plan = plan_snapshot(["store:corpus/*.txt"], SnapshotSettings(), store_url)
    assert [(f.path, f.options) for f in plan.files] == [
        (f"s3://{bucket}/store/corpus/a.txt", f"endpoint={endpoint}")
    ]
    # A local store's objects are its files: planned (and hashed) as local files are.
    root = tmp_path / "store"
    (root / "corpus").mkdir(parents=True)
    (root / "corpus" / "a.txt").write_text("alpha")
    local = plan_snapshot(["store:corpus/"], SnapshotSettings(), f"file://{root}")
    assert [(f.path, f.etag) for f in local.files] == [(str(root / "corpus" / "a.txt"), "")]
    with pytest.raises(SourceError, match="no store is configured here"):
        plan_snapshot(["store:corpus/"], SnapshotSettings())


def test_local_and_object_sources_plan_together(raw: Any, bucket: str, tmp_path: Path) -> None:
    _upload(raw, bucket, {"b.txt": "beta"})
    (tmp_path / "a.txt").write_text("alpha")
    plan = plan_snapshot([f"s3://{bucket}/b.txt", str(tmp_path / "a.txt")], SnapshotSettings())
    assert [f.path for f in plan.files] == [str(tmp_path / "a.txt"), f"s3://{bucket}/b.txt"]
