"""Two commits of the same snapshot racing (issue 17, item 5): both succeed, with one snapshot.

Two commits of one plan meet when an activity's attempt outlives its heartbeat timeout while
its retry runs, or when two runs prepare the same corpus at once. Each race here is made
deterministic: the first commit ("A") runs on a store that, at one moment of A's commit, runs
the second commit ("B") in full on the same store, then lets A carry on. Real stores only: the
local folder, and moto's S3 over HTTP without conditional writes (last writer wins there).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from dataprep.dataset_manifest import load_manifest
from dataprep.filters import FilterSettings
from dataprep.plan import SnapshotPlan, plan_snapshot
from dataprep.settings import SnapshotSettings
from dataprep.snapshot import Snapshot, commit_snapshot, run_every_stage, save_plan
from infra.digest import sha256_bytes
from infra.store.local import LocalStore
from infra.store.protocol import ObjectStore
from infra.store.s3 import S3Store
from tests.conftest import SHAKESPEARE
from tests.s3_server import new_client

# Small shards, four files of one chunk each: every chunk leaves a partial tail shard in both
# splits, so the commit merges tails (reading the work records) before it writes the report.
SETTINGS = SnapshotSettings(
    filters=FilterSettings(min_words=1), shard_tokens=4_000, chunk_bytes=20_000
)
PREFIX = "team"


class Racing:
    """Mixed into a real store: at `moment` of the commit running on it, the other commit runs
    once, in full, on the same store (its result goes to `others`)."""

    moment = ""
    other: Callable[[], Snapshot] | None = None
    others: list[Snapshot]

    def reached(self, moment: str) -> None:
        if moment == self.moment and self.other is not None:
            other, self.other = self.other, None
            self.others.append(other())

    def put_file(self, key: str, path: Path) -> None:
        self.reached("first upload")  # A has read the work records, and reads on after this
        super().put_file(key, path)  # type: ignore[misc]

    def put_if_absent(self, key: str, data: bytes) -> bool:
        if key.endswith("/MANIFEST.json"):
            self.reached("manifest put")  # A's report is uploaded, its manifest not yet put
        return super().put_if_absent(key, data)  # type: ignore[misc]


class RacingLocal(Racing, LocalStore):
    pass


class RacingS3(Racing, S3Store):
    pass


def prepare_until_commit(store: ObjectStore, sources: Path, workdir: Path) -> SnapshotPlan:
    """Every stage but the commit: the work records both commits read."""
    plan = plan_snapshot([str(sources)], SETTINGS, store.url)
    save_plan(store, plan)
    run_every_stage(store, plan, SETTINGS, workdir)
    return plan


@pytest.fixture
def sources(tmp_path: Path) -> Path:
    folder = tmp_path / "sources"
    folder.mkdir()
    text = SHAKESPEARE.read_text()
    for i in range(4):
        (folder / f"part-{i}.txt").write_text(text[i * 19_000 : (i + 1) * 19_000])
    return folder


def race(store: Racing, plain: ObjectStore, sources: Path, tmp_path: Path) -> list[Snapshot]:
    """A on `store`, B on `plain` (the same store without the race) at A's `store.moment`."""
    plan = prepare_until_commit(plain, sources, tmp_path / "stages")
    store.others = []
    store.other = lambda: commit_snapshot(plain, plan, SETTINGS, tmp_path / "b")
    first = commit_snapshot(store, plan, SETTINGS, tmp_path / "a")  # type: ignore[arg-type]
    assert store.other is None, f"B never ran: A did not reach {store.moment!r}"
    return [first, *store.others]


def assert_one_snapshot(store: ObjectStore, commits: list[Snapshot]) -> None:
    """Both commits return the stored manifest, which loads with the sha256 each returned and
    names files that all verify; the work records are gone."""
    a, b = commits
    stored = store.get_bytes(a.manifest_key)
    assert a.manifest_sha256 == b.manifest_sha256 == sha256_bytes(stored)
    for commit in commits:
        assert load_manifest(store, commit.manifest_key, commit.manifest_sha256) == a.manifest
    for entry in a.manifest.files():
        assert store.digest(entry.key) == (entry.bytes, entry.sha256), entry.key
    assert store.list(f"datasets/{a.snapshot_id}/work/") == []


@pytest.mark.parametrize("moment", ["first upload", "manifest put"])
def test_racing_commits_on_the_local_store(sources: Path, tmp_path: Path, moment: str) -> None:
    """Before: at "first upload", B's commit dropped the work records A was still reading and A
    failed (FileNotFoundError on a tail shard)."""
    store = RacingLocal(tmp_path / "store")
    store.moment = moment
    commits = race(store, LocalStore(tmp_path / "store"), sources, tmp_path)
    assert_one_snapshot(store, commits)


def _run_before_the_manifest_put(store: S3Store) -> None:
    """On A's client: B runs when A's PutObject of the manifest is about to go out, i.e. after
    A's HEAD found no manifest, the window of the fallback's check-then-put."""

    def hook(params: dict[str, Any], **_: Any) -> None:
        if params["Key"].endswith("/MANIFEST.json") and "/work/" not in params["Key"]:
            assert isinstance(store, Racing)
            store.reached("between HEAD and PUT")

    store._client.meta.events.register("provide-client-params.s3.PutObject", hook)


@pytest.mark.parametrize("moment", ["first upload", "between HEAD and PUT"])
def test_racing_commits_on_s3_without_conditional_writes(
    bucket: str, sources: Path, tmp_path: Path, moment: str
) -> None:
    """Before: at "first upload", A failed (ObjectNotFound: B had dropped the work records);
    "between HEAD and PUT", both PUTs landed and A's, with another created_at, overwrote B's
    manifest: B returned a sha256 that the stored manifest no longer had."""
    store = RacingS3(bucket, PREFIX, client=new_client(), conditional_writes=False)
    store.moment = moment
    _run_before_the_manifest_put(store)
    plain = S3Store(bucket, PREFIX, conditional_writes=False)
    commits = race(store, plain, sources, tmp_path)
    assert_one_snapshot(plain, commits)
