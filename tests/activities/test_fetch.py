"""Loading a snapshot onto a node: every file is checked by sha256 where it is loaded."""

import json
from pathlib import Path

import pytest

from activities.data_stages import dataset_ref
from activities.fetch import NodeCache
from dataprep.dataset_manifest import DatasetManifest
from dataprep.filters import FilterSettings
from dataprep.settings import SnapshotSettings
from dataprep.snapshot import prepare_snapshot
from infra.errors import IntegrityError
from infra.store.local import LocalStore
from tests.dataprep.test_dataset_manifest import STORED as STORED_MANIFEST


def test_a_corrupt_shard_is_named_and_refused(corpus: Path, tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    settings = SnapshotSettings(filters=FilterSettings(min_words=1), shard_tokens=20_000)
    snapshot = prepare_snapshot([str(corpus)], settings, store, tmp_path / "work")
    cache = NodeCache(tmp_path / "node-cache", store)
    manifest = cache.dataset_manifest(dataset_ref(snapshot))
    assert len(cache.split(manifest, "train")) == len(manifest.splits["train"].shards)

    shard = manifest.splits["train"].shards[1]
    data = bytearray((store.root / shard.key).read_bytes())
    data[100] ^= 0x01
    (store.root / shard.key).write_bytes(bytes(data))
    # A fresh node (nothing cached) must refuse it, naming the shard and both hashes.
    fresh = NodeCache(tmp_path / "other-node", store)
    with pytest.raises(IntegrityError, match=rf"{shard.key} is corrupt: expected .*sha256"):
        fresh.split(manifest, "train")


@pytest.mark.parametrize("sha256", ["../../outside", "A" * 64, "0" * 63, 7])
def test_a_manifest_cannot_choose_where_a_cached_file_lands(tmp_path: Path, sha256) -> None:
    """The cache names files by their sha256, which comes from a manifest in the store: anything
    but a hex digest is refused before a path is made of it."""
    cache = NodeCache(tmp_path / "node-cache", LocalStore(tmp_path / "store"))
    crafted = json.loads(STORED_MANIFEST.read_text())
    crafted["splits"]["train"]["shards"][0]["sha256"] = sha256
    # A digest that is not even a string is refused as the manifest is read; a string that is
    # not a hex digest, before it names a file.
    refused = r"is not a hex digest|'splits\.train\.shards\.0\.sha256'"
    with pytest.raises(IntegrityError, match=refused):
        cache.split(DatasetManifest.parse(crafted, "datasets/x/MANIFEST.json"), "train")
    assert not (tmp_path / "outside").exists()
