"""A node keeps the files of its last commit and resumes from them: the store is read only for
what the node lacks, and a copy that no longer verifies is fetched again."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from infra.errors import IntegrityError
from infra.store.local import LocalStore
from tests.trainer.test_fencing import linear
from trainer.checkpoint import Checkpointer, fetch_checkpoint, load_model_weights
from trainer.checkpoint_manifest import CheckpointFile
from trainer.local_copies import LocalCopies
from trainer.manifest import find_latest


def weights_of(folder: Path) -> torch.Tensor:
    model, _ = linear(seed=99)
    load_model_weights(model, folder)
    return model.weight


@pytest.mark.usefixtures("one_rank")
def test_a_node_resumes_from_its_own_copy_and_the_store_serves_what_it_lacks(
    tmp_path: Path,
) -> None:
    store = LocalStore(tmp_path / "store")
    copies = LocalCopies(tmp_path / "copies")
    saver = Checkpointer(store=store, staging_dir=tmp_path / "staging", run_id="r", generation=1,
                         keep=2, layout={}, asynchronous=False, local_copies=copies,
                         prunes_local_copies=True)  # fmt: skip
    model, optimizer = linear(seed=1)
    try:
        for step in (10, 20):
            optimizer.step()  # weights that differ between the two commits
            saver.save(model, optimizer, step, {"tokens_seen": step})
            assert saver.wait() is not None
    finally:
        saver.close()
    newest = find_latest(store, "r", max_generation=1)
    assert newest is not None and newest.step == 20
    files = newest.manifest.files
    # Only the newest commit's files, under their sha256, and nothing left in staging.
    assert sorted(p.name for p in copies.folder.iterdir()) == sorted(f.sha256 for f in files)
    assert not list((tmp_path / "staging").rglob("*.distcp"))

    # The node's copies alone: with the store's objects gone, the checkpoint still loads.
    held = {f.key: store.get_bytes(f.key) for f in files}
    for key in held:
        store.delete(key)
    local = fetch_checkpoint(store, newest.manifest, tmp_path / "from-copies", copies)
    assert torch.equal(weights_of(local), model.weight)

    # What the node lacks or holds corrupted comes from the store, and the bad copy goes.
    for key, data in held.items():
        store.put_bytes(key, data)
    data_file = next(f for f in files if f.name.endswith(".distcp"))
    copy = copies.folder / data_file.sha256
    flipped = bytearray(copy.read_bytes())
    flipped[len(flipped) // 2] ^= 0x01
    copy.unlink()  # a new inode: the checkpoint fetched above keeps its own link intact
    copy.write_bytes(bytes(flipped))
    (copies.folder / next(f for f in files if f is not data_file).sha256).unlink()
    mixed = fetch_checkpoint(store, newest.manifest, tmp_path / "mixed", copies)
    assert torch.equal(weights_of(mixed), model.weight)
    assert not copy.exists()

    # Neither a good copy nor a good object: the error names the file, nothing loads.
    copy.write_bytes(bytes(flipped))
    store.put_bytes(data_file.key, bytes(flipped))
    with pytest.raises(IntegrityError, match=data_file.key):
        fetch_checkpoint(store, newest.manifest, tmp_path / "neither", copies)


def test_a_copy_is_found_only_by_a_hex_digest(tmp_path: Path) -> None:
    """The name comes from a manifest in the store: a crafted one reads nothing outside."""
    (tmp_path / "secret").write_text("not a checkpoint")
    copies = LocalCopies(tmp_path / "copies")
    copies.folder.mkdir()
    entry = CheckpointFile(name="__0_0.distcp", sha256="../secret", bytes=16, key="k")
    assert not copies.place(entry, tmp_path / "dest" / "__0_0.distcp")
    assert not (tmp_path / "dest").exists()
