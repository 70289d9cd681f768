import json
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from dataprep.errors import EmptyCorpusError, SourceError
from dataprep.snapshot import SnapshotSettings, load_manifest, prepare_snapshot
from infra.digest import sha256_file
from infra.errors import IntegrityError
from infra.store import LocalStore


@pytest.fixture
def store(tmp_path: Path) -> LocalStore:
    return LocalStore(tmp_path / "store")


def test_snapshot_is_complete_and_every_file_verifies(corpus: Path, store: LocalStore) -> None:
    snap = prepare_snapshot([corpus], SnapshotSettings(shard_tokens=50_000), store)
    manifest = snap.manifest
    assert not snap.reused
    # The appended speech and its reformatted copy duplicate the corpus's first speech.
    assert manifest["documents"]["duplicates_removed"] >= 2
    train, val = manifest["splits"]["train"], manifest["splits"]["val"]
    assert len(train["shards"]) > 1  # 50k-token shards over ~180k train tokens
    assert 0.05 < val["tokens"] / (train["tokens"] + val["tokens"]) < 0.2
    for entry in [*train["shards"], *val["shards"], manifest["tokenizer"]]:
        assert store.digest(entry["key"]) == (entry["bytes"], entry["sha256"])
    for shard in train["shards"][:-1]:
        assert shard["tokens"] == 50_000
    assert manifest["sources"][0]["sha256"] == sha256_file(corpus)


def test_tokens_decode_back_to_the_documents(
    corpus: Path, store: LocalStore, tmp_path: Path
) -> None:
    snap = prepare_snapshot([corpus], SnapshotSettings(), store)
    tokenizer_file = tmp_path / "tok.json"
    store.get_file(snap.manifest["tokenizer"]["key"], tokenizer_file)
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    shard = snap.manifest["splits"]["train"]["shards"][0]
    tokens = np.frombuffer(store.get_bytes(shard["key"]), dtype=snap.manifest["dtype"])
    eod = snap.manifest["tokenizer"]["end_of_document_id"]
    first_doc = tokens[: list(tokens).index(eod)]
    assert tokenizer.decode(first_doc.tolist()) in corpus.read_text()


def test_same_sources_and_settings_reuse_the_snapshot(corpus: Path, store: LocalStore) -> None:
    first = prepare_snapshot([corpus], SnapshotSettings(), store)
    again = prepare_snapshot([corpus], SnapshotSettings(), store)
    assert again.reused and again.snapshot_id == first.snapshot_id
    assert again.manifest_sha256 == first.manifest_sha256
    other = prepare_snapshot([corpus], SnapshotSettings(tokenizer="byte"), store)
    assert other.snapshot_id != first.snapshot_id
    assert other.manifest["tokenizer"]["vocab_size"] == 257


def test_split_is_deterministic_by_document(corpus: Path, tmp_path: Path) -> None:
    a = prepare_snapshot([corpus], SnapshotSettings(), LocalStore(tmp_path / "a"))
    b = prepare_snapshot([corpus], SnapshotSettings(), LocalStore(tmp_path / "b"))
    shas = lambda m: [s["sha256"] for s in m["splits"]["val"]["shards"]]  # noqa: E731
    assert shas(a.manifest) == shas(b.manifest)


def test_changed_manifest_is_detected(corpus: Path, store: LocalStore) -> None:
    snap = prepare_snapshot([corpus], SnapshotSettings(), store)
    assert load_manifest(store, snap.manifest_key, snap.manifest_sha256)["snapshot_id"]
    tampered = json.loads(store.get_bytes(snap.manifest_key))
    tampered["dtype"] = "uint32"
    (store.root / snap.manifest_key).write_text(json.dumps(tampered))
    with pytest.raises(IntegrityError, match="modified after the run started"):
        load_manifest(store, snap.manifest_key, snap.manifest_sha256)


def test_bad_sources_get_clear_errors(tmp_path: Path, store: LocalStore) -> None:
    with pytest.raises(SourceError, match="does not exist"):
        prepare_snapshot([tmp_path / "missing.txt"], SnapshotSettings(), store)
    binary = tmp_path / "binary.txt"
    binary.write_bytes(b"ok\xff\xfe")
    with pytest.raises(SourceError, match="not UTF-8 text"):
        prepare_snapshot([binary], SnapshotSettings(), store)
    blank = tmp_path / "blank.txt"
    blank.write_text("\n\n   \n")
    with pytest.raises(EmptyCorpusError, match="no documents"):
        prepare_snapshot([blank], SnapshotSettings(), store)
    # Nothing half-made was committed.
    assert store.list("datasets/") == []
