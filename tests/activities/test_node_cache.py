"""A node's cache keeps to its byte budget (issue 17, item 13): least recently used out first,
never what a running job holds; what it advertises is what it still holds; its index survives a
restart and is rebuilt when corrupt. A real NodeCache, on real snapshots in a real LocalStore."""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from activities.data_stages import dataset_ref
from activities.fetch import NodeCache
from activities.node import NodeActivities
from dataprep.filters import FilterSettings
from dataprep.settings import SnapshotSettings
from dataprep.snapshot import prepare_snapshot
from infra.cache_budget import INDEX
from infra.settings import SettingsError, load_settings
from infra.store.local import LocalStore
from tests.conftest import SHAKESPEARE
from trainer.checkpoint_manifest import MANIFEST_FORMAT
from workflows.contracts.held_items import checkpoint_item
from workflows.contracts.models import CheckpointRef


@dataclass(frozen=True)
class Dataset:
    snapshot_id: str
    manifest: dict
    blobs: list[str]  # the train shards' sha256, their names in the cache
    bytes: int  # of the train shards together


Datasets = tuple[LocalStore, list[Dataset]]


@pytest.fixture(scope="module")
def datasets(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Datasets]:
    """Three snapshots of different text, several train shards each, in one store: A, B, C,
    with B the smallest (so that making room for B never needs more than one other)."""
    root = tmp_path_factory.mktemp("datasets")
    store = LocalStore(root / "store")
    settings = SnapshotSettings(filters=FilterSettings(min_words=1), shard_tokens=20_000)
    text = SHAKESPEARE.read_text()
    found = []
    for i in range(3):
        corpus = root / f"corpus-{i}.txt"
        corpus.write_text(text[i * 90_000 : (i + 1) * 90_000])
        snapshot = prepare_snapshot([str(corpus)], settings, store, root / f"work-{i}")
        manifest = NodeCache(root / "probe", store).dataset_manifest(dataset_ref(snapshot))
        shards = manifest.splits["train"].shards
        assert len(shards) > 1  # eviction is per blob: snapshots of several
        found.append(
            Dataset(
                snapshot.snapshot_id,
                manifest,
                [s.sha256 for s in shards],
                sum(s.bytes for s in shards),
            )
        )
    assert len({d.snapshot_id for d in found}) == 3
    smallest, a, c = sorted(found, key=lambda d: d.bytes)
    yield store, [a, smallest, c]


def on_disk(cache_root: Path, dataset: Dataset) -> list[bool]:
    return [(cache_root / "blobs" / sha).is_file() for sha in dataset.blobs]


def test_the_least_recently_used_snapshot_leaves_disk_and_advertisement(
    datasets: Datasets, tmp_path: Path
) -> None:
    """Three snapshots that do not fit together: the one used longest ago is evicted, not the
    first one fetched, which a job used again since."""
    store, (a, b, c) = datasets
    root = tmp_path / "cache"
    cache = NodeCache(root, store, budget_bytes=a.bytes + c.bytes)
    cache.split(a.manifest, "train")
    cache.split(b.manifest, "train")
    assert cache.held_snapshots() == [b.snapshot_id, a.snapshot_id]
    cache.split(a.manifest, "train")  # a job of A again: verified, so used now
    cache.split(c.manifest, "train")  # over budget: room is made

    assert all(on_disk(root, a)) and all(on_disk(root, c))
    assert not any(on_disk(root, b)), "the least recently used snapshot stayed on disk"
    assert cache.held_snapshots() == [c.snapshot_id, a.snapshot_id]
    assert sum(f.stat().st_size for f in (root / "blobs").iterdir()) == a.bytes + c.bytes
    assert cache.budget.used_bytes() == a.bytes + c.bytes


def test_a_running_job_keeps_what_it_uses_even_when_it_is_the_oldest(
    datasets: Datasets, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store, (a, b, c) = datasets
    root = tmp_path / "cache"
    checkpoint = _put_checkpoint(store, "runs/r/checkpoints/step-10/gen-1", a.bytes // 4)
    budget = checkpoint.size + a.bytes + c.bytes
    cache = NodeCache(root, store, budget_bytes=budget)
    with cache.lease() as job:  # a job resuming on A: its checkpoint, then its shards
        folder, _ = job.checkpoint(checkpoint.ref)
        job.split(a.manifest, "train")
        cache.split(b.manifest, "train")  # other jobs on this node, later
        cache.split(c.manifest, "train")  # over budget: the oldest are the job's
        assert all(on_disk(root, a)) and (folder / "shard-0.bin").is_file()
        assert not any(on_disk(root, b)), "B was the oldest entry no running job holds"
        assert cache.held_snapshots() == [c.snapshot_id, a.snapshot_id]
    # The job is over: its checkpoint and shards are the least recently used now, and go first.
    cache.split(b.manifest, "train")
    assert not folder.exists() and not (root / "checkpoints" / "runs").exists()
    assert not all(on_disk(root, a)) and all(on_disk(root, c)) and all(on_disk(root, b))
    assert cache.held_snapshots() == [b.snapshot_id, c.snapshot_id]
    assert cache.budget.used_bytes() <= budget

    # What a running job holds may alone exceed the budget: the job still gets it, and the
    # log says so.
    small = NodeCache(tmp_path / "small", store, budget_bytes=a.bytes // 2)
    with caplog.at_level(logging.WARNING, logger="infra.cache_budget"), small.lease() as job:
        job.split(a.manifest, "train")
        assert all(on_disk(tmp_path / "small", a))
    assert "over its budget" in caplog.text and "running jobs' own entries" in caplog.text


def test_the_index_survives_a_restart_and_a_corrupt_one_is_rebuilt(
    datasets: Datasets, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store, (a, b, c) = datasets
    root = tmp_path / "cache"
    budget = a.bytes + c.bytes
    first = NodeCache(root, store, budget_bytes=budget)
    for dataset in (c, a, c):  # C was fetched (written) first, but used last
        first.split(dataset.manifest, "train")
    assert first.held_snapshots() == [c.snapshot_id, a.snapshot_id]
    assert (root / INDEX).is_file()

    # The agent restarts: the order of use and what is held come back from the index (the
    # files' times alone would say C is the older).
    second = NodeCache(root, store, budget_bytes=budget)
    assert second.held_snapshots() == [c.snapshot_id, a.snapshot_id]
    second.split(b.manifest, "train")
    assert all(on_disk(root, c)), "C was used after A: after the restart A goes first"
    assert not all(on_disk(root, a)) and all(on_disk(root, b))
    assert second.held_snapshots() == [b.snapshot_id, c.snapshot_id]

    # A torn or foreign index: rebuilt from the files on disk, none of them unaccounted for.
    (root / INDEX).write_text('{"entries": {"blobs/x": {"bytes": "many"}')
    with caplog.at_level(logging.WARNING, logger="infra.cache_budget"):
        rebuilt = NodeCache(root, store, budget_bytes=budget)
    assert "rebuilding it from the disk" in caplog.text
    held = sum(f.stat().st_size for f in (root / "blobs").iterdir())
    assert rebuilt.budget.used_bytes() == held <= budget
    rebuilt.split(a.manifest, "train")  # and it still keeps to its budget
    assert all(on_disk(root, a)) and rebuilt.budget.used_bytes() <= budget
    assert rebuilt.held_snapshots()[0] == a.snapshot_id
    json.loads((root / INDEX).read_text())  # written whole again
    (root / INDEX).unlink()  # a missing one is rebuilt too
    again = NodeCache(root, store, budget_bytes=budget)
    assert again.budget.used_bytes() == sum(f.stat().st_size for f in (root / "blobs").iterdir())


def test_the_budget_is_a_setting_of_the_node_agent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FORGELINE_STORE", str(tmp_path / "store"))
    monkeypatch.setenv("FORGELINE_NODE_CACHE_GB", "2.5")
    agent = NodeActivities(load_settings(tmp_path / "home"), "n0")
    assert agent.cache.budget.budget_bytes == 2_500_000_000
    monkeypatch.setenv("FORGELINE_NODE_CACHE_GB", "lots")
    with pytest.raises(SettingsError, match="FORGELINE_NODE_CACHE_GB='lots' is not a number"):
        load_settings(tmp_path / "home")
    monkeypatch.setenv("FORGELINE_NODE_CACHE_GB", "0")
    with pytest.raises(SettingsError, match="positive number of GB"):
        load_settings(tmp_path / "home")
    monkeypatch.delenv("FORGELINE_NODE_CACHE_GB")
    default = NodeActivities(load_settings(tmp_path / "home"), "n0").cache.budget.budget_bytes
    assert 0 < default < 2**63  # a share of the disk the cache is on


@dataclass(frozen=True)
class _Checkpoint:
    ref: CheckpointRef
    size: int


def _put_checkpoint(store: LocalStore, folder: str, size: int) -> _Checkpoint:
    """A committed checkpoint of one file: what resume fetches into the node's cache."""
    data = bytes(range(256)) * (size // 256 + 1)
    data = data[:size]
    key = f"{folder}/shard-0.bin"
    store.put_bytes(key, data)
    manifest = {
        "format": MANIFEST_FORMAT,
        "step": 10,
        "generation": 1,
        "files": [
            {
                "name": "shard-0.bin",
                "key": key,
                "bytes": len(data),
                "sha256": hashlib.sha256(data).hexdigest(),
            }
        ],
    }
    manifest_key = f"{folder}/MANIFEST.json"
    store.put_bytes(manifest_key, json.dumps(manifest).encode())
    ref = CheckpointRef(manifest_key=manifest_key, step=10, generation=1, tokens_seen=0)
    return _Checkpoint(ref, len(data))


def test_what_a_node_advertises_with_sizes_and_its_record_of_fetches(
    datasets: Datasets, tmp_path: Path
) -> None:
    """`held()` lists datasets and checkpoints by the ids runs ask with, with their bytes, the
    most recently used first; a checkpoint found in the cache is not fetched again, and its
    entry says when it was fetched (unchanged) and when it was used (later)."""
    store, (a, _b, _c) = datasets
    base = _put_checkpoint(store, "runs/base/checkpoints/step-10", 50_000)
    cache = NodeCache(tmp_path / "cache", store, budget_bytes=10 * a.bytes)
    cache.split(a.manifest, "train")
    cache.checkpoint(base.ref)
    item = checkpoint_item(base.ref.manifest_key)
    assert cache.held() == {item: base.size, a.snapshot_id: a.bytes}
    rel = "checkpoints/runs/base/checkpoints/step-10"
    first = cache.budget.entry(rel)
    assert first is not None and first.fetched_at > 0

    again = NodeCache(tmp_path / "cache", store, budget_bytes=10 * a.bytes)  # a new agent
    again.split(a.manifest, "train")  # the dataset, used last
    assert list(again.held()) == [a.snapshot_id, item]
    again.checkpoint(base.ref)
    second = again.budget.entry(rel)
    assert second is not None and second.fetched_at == first.fetched_at
    assert second.used > first.used


@pytest.mark.parametrize("hot", [True, False])
def test_a_hot_base_model_is_evicted_after_what_is_not_hot(
    datasets: Datasets, tmp_path: Path, hot: bool
) -> None:
    """The hot pool's model, warmed first (so used longest ago), stays when room is made for
    a dataset; the dataset used since goes instead. Not hot, it goes first, as LRU says."""
    store, (a, _b, c) = datasets
    base = _put_checkpoint(store, "runs/base/checkpoints/step-10", 50_000)
    item = checkpoint_item(base.ref.manifest_key)
    cache = NodeCache(tmp_path / "cache", store, budget_bytes=base.size + a.bytes + c.bytes - 1)
    assert cache.warm(base.ref.manifest_key, [item] if hot else []) == base.size
    cache.split(a.manifest, "train")
    cache.split(c.manifest, "train")  # over budget: one of base and A leaves
    held = cache.held()
    assert c.snapshot_id in held
    if hot:
        assert item in held and a.snapshot_id not in held
    else:
        assert item not in held and a.snapshot_id in held
