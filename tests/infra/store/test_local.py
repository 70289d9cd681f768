from pathlib import Path

import pytest

from infra.digest import sha256_bytes
from infra.errors import IntegrityError, InvalidKey, ObjectNotFound, StoreError
from infra.store.factory import open_store
from infra.store.local import LocalStore
from infra.store.protocol import fetch_verified


@pytest.fixture
def store(tmp_path: Path) -> LocalStore:
    return LocalStore(tmp_path / "store")


def test_put_get_list_delete(store: LocalStore) -> None:
    store.put_bytes("runs/a/x.bin", b"hello")
    store.put_bytes("runs/a/sub/y.bin", b"world")
    assert store.get_bytes("runs/a/x.bin") == b"hello"
    assert store.list("runs/a/") == ["runs/a/sub/y.bin", "runs/a/x.bin"]
    assert store.digest("runs/a/x.bin") == (5, sha256_bytes(b"hello"))
    store.delete("runs/a/x.bin")
    assert not store.exists("runs/a/x.bin")
    store.delete("runs/a/sub/y.bin")
    assert not (store.root / "runs").exists()  # no empty folders are left behind
    with pytest.raises(ObjectNotFound):
        store.get_bytes("runs/a/x.bin")


def test_put_if_absent_creates_once(store: LocalStore) -> None:
    assert store.put_if_absent("m/MANIFEST.json", b"first")
    assert not store.put_if_absent("m/MANIFEST.json", b"second")
    assert store.get_bytes("m/MANIFEST.json") == b"first"
    # No temporary files are left behind by the refused put.
    assert store.list("m/") == ["m/MANIFEST.json"]


@pytest.mark.parametrize(
    "key", ["", "../escape", "a/../../b", "/abs", "a//b", "a/./b", "a/b c", "a/.tmp-x"]
)
def test_keys_that_could_escape_are_rejected(store: LocalStore, key: str) -> None:
    with pytest.raises(InvalidKey, match="not allowed"):
        store.put_bytes(key, b"x")


def test_fetch_verified_detects_corruption(store: LocalStore, tmp_path: Path) -> None:
    store.put_bytes("d/shard.bin", b"0123456789")
    sha = sha256_bytes(b"0123456789")
    dest = tmp_path / "cache" / "shard.bin"
    fetch_verified(store, "d/shard.bin", dest, sha, 10)
    assert dest.read_bytes() == b"0123456789"

    # Flip a byte in the stored object: the next fetch names the key and both hashes.
    (store.root / "d" / "shard.bin").write_bytes(b"0123456780")
    dest.unlink()
    with pytest.raises(IntegrityError, match=r"d/shard\.bin is corrupt"):
        fetch_verified(store, "d/shard.bin", dest, sha, 10)
    assert not dest.exists()


def test_fetch_verified_replaces_a_damaged_cached_copy(store: LocalStore, tmp_path: Path) -> None:
    store.put_bytes("d/shard.bin", b"abc")
    dest = tmp_path / "shard.bin"
    dest.write_bytes(b"abd")
    fetch_verified(store, "d/shard.bin", dest, sha256_bytes(b"abc"), 3)
    assert dest.read_bytes() == b"abc"


def test_open_store(tmp_path: Path) -> None:
    assert isinstance(open_store(str(tmp_path / "s")), LocalStore)
    assert isinstance(open_store(f"file://{tmp_path / 's'}"), LocalStore)
    with pytest.raises(StoreError, match="scheme 'gs'"):
        open_store("gs://bucket/x")
