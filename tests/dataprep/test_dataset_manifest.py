"""The dataset manifest as a typed format: one written before it was typed loads, and is
written back byte for byte (runs hold its sha256); one this build cannot read is refused with
the key and the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dataprep.dataset_manifest import DatasetManifest, load_manifest
from infra.digest import sha256_bytes
from infra.errors import IntegrityError
from infra.store.local import LocalStore
from infra.stored_format import StoredFormatError

# Committed by the local stack from tinyshakespeare with the code before the manifest was typed.
STORED = Path(__file__).parent / "stored" / "dataset-manifest-v2.json"
KEY = "datasets/2331578158842b7045b0/MANIFEST.json"


def test_a_manifest_written_before_the_types_loads_and_dumps_to_the_same_bytes() -> None:
    raw = STORED.read_bytes()
    manifest = DatasetManifest.parse(raw, KEY)
    assert manifest.snapshot_id == "2331578158842b7045b0" and manifest.dtype == "uint16"
    assert manifest.tokenizer.vocab_size > 0 and manifest.documents.read > 0
    assert manifest.splits["train"].tokens == sum(s.tokens for s in manifest.splits["train"].shards)
    assert [f.key.rsplit("/", 1)[-1] for f in manifest.files()][-3:] == [
        "tokenizer.json",
        "documents.parquet",
        "report.json",
    ]
    # The sha256 a run was given is of these bytes: the typed dump must not change one.
    assert manifest.dump_bytes() == raw


def test_loading_checks_the_sha256_then_the_format(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    store.put_bytes(KEY, STORED.read_bytes())
    loaded = load_manifest(store, KEY, sha256_bytes(STORED.read_bytes()))
    assert loaded.snapshot_id == "2331578158842b7045b0"
    with pytest.raises(IntegrityError, match="modified after the run started"):
        load_manifest(store, KEY, "0" * 64)
    newer = {**json.loads(STORED.read_bytes()), "format": "forgeline.dataset/3"}
    data = json.dumps(newer).encode()
    store.put_bytes(KEY, data)
    refused = r"'forgeline\.dataset/3'.*reads forgeline\.dataset/2"
    with pytest.raises(StoredFormatError, match=refused):
        load_manifest(store, KEY, sha256_bytes(data))


def test_a_missing_field_is_named_with_its_place() -> None:
    broken = json.loads(STORED.read_bytes())
    del broken["splits"]["val"]["shards"][0]["sha256"]
    with pytest.raises(StoredFormatError) as refused:
        DatasetManifest.parse(broken, KEY)
    assert str(refused.value).startswith(KEY)
    assert "field 'splits.val.shards.0.sha256': field required" in str(refused.value)
