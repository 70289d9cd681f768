"""The whole data-preparation pipeline in one process, on real files, DuckDB and tokenizers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import duckdb
import numpy as np
import pytest
from tokenizers import Tokenizer

from dataprep.dataset_manifest import DatasetManifest, load_manifest
from dataprep.errors import BadRecordsError, EmptyCorpusError, SourceError
from dataprep.filters import FilterSettings
from dataprep.settings import DedupSettings, SnapshotSettings, TokenizerSettings
from dataprep.snapshot import prepare_snapshot
from infra.errors import IntegrityError
from infra.store.local import LocalStore
from tests.conftest import REPO, SHAKESPEARE
from tests.dataprep.corpora import planted_jsonl

SPEECHES = SnapshotSettings(filters=FilterSettings(min_words=1))  # speeches are short


@pytest.fixture
def store(tmp_path: Path) -> LocalStore:
    return LocalStore(tmp_path / "store")


def prepare(paths: list[Path], settings: SnapshotSettings, store: LocalStore, tmp_path: Path):
    return prepare_snapshot([str(p) for p in paths], settings, store, tmp_path / "work")


def documents_table(store: LocalStore, manifest: DatasetManifest) -> list[dict]:
    path = store.root / manifest.report["documents"].key
    cursor = duckdb.sql(f"SELECT * FROM read_parquet('{path}') ORDER BY doc_id")
    return [dict(zip(cursor.columns, row, strict=True)) for row in cursor.fetchall()]


def test_snapshot_is_complete_and_every_file_verifies(
    corpus: Path, store: LocalStore, tmp_path: Path
) -> None:
    settings = SnapshotSettings(filters=FilterSettings(min_words=1), shard_tokens=20_000)
    snap = prepare([corpus], settings, store, tmp_path)
    manifest = snap.manifest
    assert not snap.reused
    # The appended speech and its reformatted copy duplicate the corpus's first speech.
    assert manifest.documents.exact_duplicates >= 2
    train, val = manifest.splits["train"], manifest.splits["val"]
    assert 0.05 < val.tokens / (train.tokens + val.tokens) < 0.2
    for split in (train, val):
        sizes = [s.tokens for s in split.shards]
        assert all(n == 20_000 for n in sizes[:-1]) and 0 < sizes[-1] <= 20_000
        assert sum(sizes) == split.tokens
    for entry in [*train.shards, *val.shards, manifest.tokenizer]:
        assert store.digest(entry.key) == (entry.bytes, entry.sha256)
    assert manifest.sources[0].path == str(corpus)
    assert store.list(f"datasets/{snap.snapshot_id}/work/") == []  # intermediates are gone
    rows = documents_table(store, manifest)
    assert len(rows) == manifest.documents.read
    kept = [r for r in rows if r["status"] == "kept"]
    assert sum(r["tokens"] for r in kept) == train.tokens + val.tokens


def test_tokens_decode_back_to_the_documents(
    corpus: Path, store: LocalStore, tmp_path: Path
) -> None:
    snap = prepare([corpus], SPEECHES, store, tmp_path)
    manifest = snap.manifest
    tokenizer = Tokenizer.from_file(str(store.root / manifest.tokenizer.key))
    shard = manifest.splits["train"].shards[0]
    tokens = np.fromfile(store.root / shard.key, dtype=manifest.dtype).tolist()
    eod = manifest.tokenizer.end_of_document_id
    first = tokens[: tokens.index(eod)]
    assert (
        tokenizer.decode(first) == "First Citizen:\nBefore we proceed any further, hear me speak."
    )


def test_same_sources_and_settings_reuse_the_snapshot(
    corpus: Path, store: LocalStore, tmp_path: Path
) -> None:
    first = prepare([corpus], SPEECHES, store, tmp_path)
    again = prepare([corpus], SPEECHES, store, tmp_path)
    assert again.reused and again.snapshot_id == first.snapshot_id
    assert again.manifest_sha256 == first.manifest_sha256
    other = prepare(
        [corpus],
        SnapshotSettings(
            filters=FilterSettings(min_words=1), tokenizer=TokenizerSettings(kind="byte")
        ),
        store,
        tmp_path,
    )
    assert other.snapshot_id != first.snapshot_id
    assert other.manifest.tokenizer.vocab_size == 257


def test_planted_near_duplicates_are_found(store: LocalStore, tmp_path: Path) -> None:
    planted = planted_jsonl(tmp_path / "planted.jsonl")
    settings = SnapshotSettings(
        filters=FilterSettings(gopher=False), dedup=DedupSettings(verify=True)
    )
    snap = prepare([planted.path], settings, store, tmp_path)
    by_line = {r["position"]: r for r in documents_table(store, snap.manifest)}
    near = [line for line in planted.near_copies if by_line[line]["status"] == "near"]
    assert len(near) >= 0.97 * len(planted.near_copies)  # LSH 14×8 at J = 0.87: p ≈ 0.996
    assert all(by_line[line]["status"] == "kept" for line in planted.distant)  # J ≈ 0.5: kept
    assert all(by_line[line]["status"] == "exact" for line in planted.exact_copies)
    for line in near:  # the copy points at its base, the line just before it
        assert by_line[line]["duplicate_of"] == by_line[line - 1]["doc_id"]
    report = json.loads((store.root / snap.manifest.report["summary"].key).read_bytes())
    assert report["documents"]["near_duplicates"] == len(near)
    assert report["dedup"]["verified_pairs"] >= len(near)
    assert report["dedup_examples"][0]["jaccard"] >= 0.8


def test_mixed_sources_with_bad_records(store: LocalStore, tmp_path: Path) -> None:
    code = tmp_path / "code"
    (code / "pkg").mkdir(parents=True)
    (code / "pkg" / "mod.py").write_text("def f(x):\n    return x + 1\n")
    (code / "main.c").write_text("int main(void) { return 0; }\n")
    (code / "notes.bin").write_bytes(b"\x00\x01")  # unknown extension inside a folder: skipped
    records = [json.dumps({"text": f"record {i} " + "word " * 60}) for i in range(200)]
    records.insert(50, "{not json")
    (tmp_path / "web.jsonl").write_text("\n".join(records))
    settings = SnapshotSettings(
        filters=FilterSettings(min_words=1),
        reader=SnapshotSettings().reader.__class__(max_bad_fraction=0.05),
    )
    snap = prepare([code, tmp_path / "web.jsonl", SHAKESPEARE], settings, store, tmp_path)
    report = json.loads((store.root / snap.manifest.report["summary"].key).read_bytes())
    kinds = {(r["kind"], r["language"]) for r in report["by_kind"]}
    assert {("code", "c"), ("code", "python"), ("text", "")} <= kinds
    assert report["bad_records"]["by_reason"] == {"invalid JSON": 1}
    assert report["bad_records"]["examples"][0]["line"] == 51
    sources = {r["source"] for r in report["by_source"]}
    assert str(code / "pkg" / "mod.py") in sources and str(SHAKESPEARE) in sources


def test_bad_input_gets_clear_errors_and_commits_nothing(store: LocalStore, tmp_path: Path) -> None:
    with pytest.raises(SourceError, match=r"missing\.txt"):
        prepare([tmp_path / "missing.txt"], SPEECHES, store, tmp_path)
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(b"\xff\xfe\x00garbage\n" * 50)
    with pytest.raises(BadRecordsError, match=r"binary\.jsonl: 50 of 50 records are bad.*line 1"):
        prepare([binary], SPEECHES, store, tmp_path)
    blank = tmp_path / "blank.txt"
    blank.write_text("\n\n   \n")
    with pytest.raises(EmptyCorpusError, match="no documents were read"):
        prepare([blank], SPEECHES, store, tmp_path)
    with pytest.raises(EmptyCorpusError, match=r"every document was removed.*\[data\.filters\]"):
        prepare(
            [SHAKESPEARE],
            SnapshotSettings(filters=FilterSettings(min_chars=10**5)),
            store,
            tmp_path,
        )
    assert [k for k in store.list("datasets/") if k.endswith("MANIFEST.json")] == []


def test_a_stage_killed_midway_resumes_where_it_stopped(store: LocalStore, tmp_path: Path) -> None:
    parts = tmp_path / "parts"
    parts.mkdir()
    text = SHAKESPEARE.read_text()
    for i in range(24):  # 24 files of ~46 KB in chunks of one file each
        (parts / f"part-{i:02d}.txt").write_text(text[i * 46_000 : (i + 1) * 46_000])
    settings = SnapshotSettings(filters=FilterSettings(min_words=1), chunk_bytes=40_000)

    script = (
        "from pathlib import Path; from infra.store.local import LocalStore;"
        "from dataprep.snapshot import prepare_snapshot; from dataprep.settings import *;"
        "from dataprep.filters import FilterSettings;"
        "settings = SnapshotSettings(filters=FilterSettings(min_words=1), chunk_bytes=40_000);"
        f"store = LocalStore(Path({str(store.root)!r}));"
        f"prepare_snapshot([{str(parts)!r}], settings, store, Path({str(tmp_path / 'w1')!r}))"
    )
    child = subprocess.Popen([sys.executable, "-c", script], cwd=REPO)
    deadline = time.monotonic() + 120
    scanned: list[str] = []
    while len(scanned) < 6:
        scanned = [k for k in store.list("datasets/") if "/work/scan/chunk-" in k]
        assert child.poll() is None and time.monotonic() < deadline, "finished before the kill"
        time.sleep(0.01)
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    done_before = len([k for k in store.list("datasets/") if "/work/scan/chunk-" in k])
    assert 6 <= done_before < 24

    messages: list[str] = []
    resumed = prepare_snapshot([str(parts)], settings, store, tmp_path / "w2", messages.append)
    assert sum(m.startswith("scan of chunk") and m.endswith("already done") for m in messages) == (
        done_before
    )

    clean = prepare_snapshot(
        [str(parts)], settings, LocalStore(tmp_path / "clean"), tmp_path / "w3"
    )
    assert resumed.snapshot_id == clean.snapshot_id
    shards = lambda m: [s.sha256 for split in m.splits.values() for s in split.shards]  # noqa: E731
    assert shards(resumed.manifest) == shards(clean.manifest)


def test_bpe_snapshot(corpus: Path, store: LocalStore, tmp_path: Path) -> None:
    settings = SnapshotSettings(
        filters=FilterSettings(min_words=1), tokenizer=TokenizerSettings(kind="bpe", vocab_size=600)
    )
    snap = prepare([corpus], settings, store, tmp_path)
    assert snap.manifest.tokenizer.kind == "bpe"
    assert snap.manifest.tokenizer.vocab_size == 600
    assert snap.manifest.dtype == "uint16"
    # Merges compress: fewer tokens than characters.
    assert snap.manifest.splits["train"].tokens < 0.6 * corpus.stat().st_size


def test_changed_manifest_is_detected(corpus: Path, store: LocalStore, tmp_path: Path) -> None:
    snap = prepare([corpus], SPEECHES, store, tmp_path)
    assert load_manifest(store, snap.manifest_key, snap.manifest_sha256).snapshot_id
    tampered = json.loads(store.get_bytes(snap.manifest_key))
    tampered["dtype"] = "uint32"
    (store.root / snap.manifest_key).write_text(json.dumps(tampered))
    with pytest.raises(IntegrityError, match="modified after the run started"):
        load_manifest(store, snap.manifest_key, snap.manifest_sha256)
