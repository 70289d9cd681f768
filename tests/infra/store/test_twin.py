"""The twin site: replication of committed units, and a primary that drops off the network.

Replication is tested between two local folders (it only needs the store contract). Failover
needs a primary that really becomes unreachable: an S3 server (moto, over HTTP) behind a TCP
forwarder that the test cuts and heals (tests/partition.py).
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from infra import code_snapshot
from infra.errors import ObjectNotFound, StoreUnavailable
from infra.replication import STATUS_KEY, ReplicationStatus, Replicator
from infra.store.factory import open_store
from infra.store.local import LocalStore
from infra.store.s3 import S3Store, client_config
from infra.store.twin import TwinStore
from tests.partition import Partition
from tests.trainer.test_fencing import commit
from trainer.manifest import find_latest

COMMITTED = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)


def checkpoint(
    store: LocalStore, run: str, step: int, *, committed: bool = True, generation: int | None = None
) -> str:
    """A checkpoint's files and manifest; in a generation's folder, or (None) in the former
    layout, directly in step-<n>/."""
    folder = f"runs/{run}/checkpoints/step-{step}"
    if generation is not None:
        folder += f"/gen-{generation}"
    store.put_bytes(f"{folder}/__0_0.distcp", f"weights of {step}".encode() * 100)
    store.put_bytes(f"{folder}/.metadata", b"metadata")
    if committed:
        manifest = {"step": step, "committed_at": COMMITTED.isoformat()}
        store.put_if_absent(f"{folder}/MANIFEST.json", json.dumps(manifest).encode())
    return f"{folder}/MANIFEST.json"


class Clock:
    def __init__(self, start: datetime) -> None:
        self.now = start

    def __call__(self) -> datetime:
        return self.now


def test_committed_units_and_run_records_replicate_manifest_last(tmp_path: Path) -> None:
    primary, twin = LocalStore(tmp_path / "primary"), LocalStore(tmp_path / "twin")
    done = checkpoint(primary, "r", 100)
    checkpoint(primary, "r", 150, committed=False)  # a save in flight: not a checkpoint yet
    primary.put_bytes("datasets/abc/shards/train-00000.bin", b"tokens")
    primary.put_bytes("datasets/abc/work/scan/part-0", b"staging")  # dropped at commit
    primary.put_bytes("datasets/abc/MANIFEST.json", b'{"created_at": "2026-11-29T11:00:00+00:00"}')
    primary.put_bytes("runs/r/generations/gen-1.json", b'{"generation": 1}')
    # Whose the run's checkpoints are, and which are registered (trainer.run_identity): a run
    # resuming from the twin must find its claim there, not checkpoints nobody owns.
    primary.put_bytes("runs/r/identity.json", b'{"run_uid": "u1"}')
    primary.put_bytes("runs/r/pins/step-100-gen-1.json", done.encode())
    primary.put_bytes("datasets/new/MANIFEST.json", b'{"splits": {}}')  # no time in it
    clock = Clock(COMMITTED + timedelta(seconds=3))

    status = Replicator(primary, twin, tmp_path / "scratch", clock).run_once()

    assert twin.get_bytes(done) == primary.get_bytes(done)
    assert twin.list("runs/r/checkpoints/step-100/") == primary.list("runs/r/checkpoints/step-100/")
    assert twin.list("runs/r/checkpoints/step-150/") == []
    assert twin.exists("datasets/abc/shards/train-00000.bin")
    assert not twin.exists("datasets/abc/work/scan/part-0")
    assert twin.get_bytes("runs/r/generations/gen-1.json") == b'{"generation": 1}'
    assert twin.get_bytes("runs/r/identity.json") == b'{"run_uid": "u1"}'
    assert twin.get_bytes("runs/r/pins/step-100-gen-1.json") == done.encode()
    lags = {entry.manifest_key: entry.lag_s for entry in status.recent}
    assert lags[done] == 3.0 and lags["datasets/abc/MANIFEST.json"] == 3603.0
    assert lags["datasets/new/MANIFEST.json"] == 0.0  # from the pass's start: a lower bound
    assert status.pending == [] and status.primary_reachable
    # The status lives on the twin, readable while the primary is down.
    assert ReplicationStatus.read(twin) == status and twin.exists(STATUS_KEY)

    # A record that changes is copied again; a unit already there is not looked at again.
    primary.put_bytes("runs/r/generations/gen-1.json", b'{"generation": 1, "fenced": 120}')
    assert Replicator(primary, twin, tmp_path / "scratch", clock).run_once().recent == []
    assert twin.get_bytes("runs/r/generations/gen-1.json").endswith(b"120}")


def test_a_generation_s_checkpoint_is_a_unit_of_its_own(tmp_path: Path) -> None:
    """Checkpoints live in step-<n>/gen-<g>/; one of the former layout (step-<n>/ itself) does
    not take a generation folder beside its files for its own."""
    primary, twin = LocalStore(tmp_path / "primary"), LocalStore(tmp_path / "twin")
    former = checkpoint(primary, "r", 100)
    checkpoint(primary, "r", 100, generation=2, committed=False)  # uploading, uncommitted
    ours = checkpoint(primary, "r", 200, generation=2)
    clock = Clock(COMMITTED + timedelta(seconds=1))
    status = Replicator(primary, twin, tmp_path / "scratch", clock).run_once()
    assert {(e.manifest_key, e.objects) for e in status.recent} == {(former, 3), (ours, 3)}
    assert twin.list("runs/r/checkpoints/step-100/gen-2/") == []
    assert twin.list("runs/r/checkpoints/step-200/") == primary.list("runs/r/checkpoints/step-200/")


def test_a_checkpoint_pruned_while_being_copied_leaves_no_manifest_on_the_twin(
    tmp_path: Path,
) -> None:
    primary, twin = LocalStore(tmp_path / "primary"), LocalStore(tmp_path / "twin")
    key = checkpoint(primary, "r", 100)
    replicator = Replicator(primary, twin, tmp_path / "scratch")
    keys = primary.list("")
    primary.delete("runs/r/checkpoints/step-100/__0_0.distcp")  # pruned after the listing
    replicator._unit(key, keys)
    assert not twin.exists(key)


def fast_failing(bucket: str, port: int) -> S3Store:
    """A store at the forwarder's port that gives up at once: failover tests need no retries."""
    import boto3

    client = boto3.session.Session().client(
        "s3", endpoint_url=f"http://127.0.0.1:{port}", config=client_config(max_attempts=1)
    )
    return S3Store(bucket, "site", client=client)


@pytest.fixture
def partitioned(endpoint: str, bucket: str, raw: Any, tmp_path: Path) -> Any:
    partition = Partition(int(endpoint.rsplit(":", 1)[1]))
    partition.heal()
    yield partition, fast_failing(bucket, partition.port)
    partition.cut()


def test_reads_and_writes_go_to_the_twin_while_the_primary_is_unreachable(
    partitioned: Any, tmp_path: Path
) -> None:
    partition, primary = partitioned
    twin = LocalStore(tmp_path / "twin")
    ticks = [0.0]
    store = TwinStore(primary, twin, retry_after_s=30, clock=lambda: ticks[0])
    store.put_bytes("runs/r/checkpoints/step-10/MANIFEST.json", b"on the primary")
    twin.put_bytes("runs/r/checkpoints/step-10/MANIFEST.json", b"replicated")
    assert store.get_bytes("runs/r/checkpoints/step-10/MANIFEST.json") == b"on the primary"

    partition.cut()
    # Reads come from the twin; the primary is marked down and left alone for retry_after_s.
    assert store.get_bytes("runs/r/checkpoints/step-10/MANIFEST.json") == b"replicated"
    assert store.primary_down
    # Writes (a checkpoint committed during the outage) land on the twin.
    assert store.put_if_absent("runs/r/checkpoints/step-20/MANIFEST.json", b"failover")
    assert twin.get_bytes("runs/r/checkpoints/step-20/MANIFEST.json") == b"failover"
    assert store.list("runs/r/checkpoints/") == [
        "runs/r/checkpoints/step-10/MANIFEST.json",
        "runs/r/checkpoints/step-20/MANIFEST.json",
    ]

    partition.heal()
    ticks[0] = 31.0  # past retry_after_s: the primary is asked again, and serves what it has
    assert store.get_bytes("runs/r/checkpoints/step-10/MANIFEST.json") == b"on the primary"
    assert not store.primary_down
    # The outage's writes stay readable: the union of both sites, the primary first.
    assert store.get_bytes("runs/r/checkpoints/step-20/MANIFEST.json") == b"failover"
    assert len(store.list("runs/r/checkpoints/")) == 2
    store.delete("runs/r/checkpoints/step-20/MANIFEST.json")  # pruning reaches both sites
    with pytest.raises(ObjectNotFound):
        store.get_bytes("runs/r/checkpoints/step-20/MANIFEST.json")


def test_a_read_only_the_primary_can_answer_asks_it_while_it_is_presumed_down(
    partitioned: Any, tmp_path: Path
) -> None:
    """The slow e2e: an agent that met the outage left the primary alone for 30 s after it
    healed, and its next job's code snapshot, published on the primary just then, was not on
    the twin: the job failed on a store that was up."""
    partition, primary = partitioned
    store = TwinStore(primary, LocalStore(tmp_path / "twin"), retry_after_s=30)
    partition.cut()
    assert not store.exists("code/0123/MANIFEST.json") and store.primary_down
    partition.heal()
    primary.put_bytes("code/0123/MANIFEST.json", b"published since")
    assert store.get_bytes("code/0123/MANIFEST.json") == b"published since"
    assert not store.primary_down  # it answered: asked first again from now on
    partition.cut()
    with pytest.raises(StoreUnavailable):  # truly down, and the twin lacks it: still an outage
        store.get_bytes("code/0123/MANIFEST.json")


def test_a_listing_asks_a_primary_presumed_down_once_it_is_back(
    partitioned: Any, tmp_path: Path
) -> None:
    """The slow e2e: the control worker met the twin test's outage, and within 30 s of the heal it
    listed a healthy run's checkpoints on the twin alone: step 40 (replicated), not the step 60
    its ranks had just committed to the primary. The run failed, finished and healthy."""
    partition, primary = partitioned
    twin = LocalStore(tmp_path / "twin")
    ticks = [0.0]
    store = TwinStore(primary, twin, retry_after_s=30, probe_every_s=1, clock=lambda: ticks[0])
    twin.put_bytes("runs/r/checkpoints/step-40/MANIFEST.json", b"replicated")
    partition.cut()
    assert store.list("runs/r/checkpoints/") == ["runs/r/checkpoints/step-40/MANIFEST.json"]
    assert store.primary_down
    partition.heal()
    primary.put_bytes("runs/r/checkpoints/step-60/MANIFEST.json", b"committed since")
    ticks[0] = 5.0  # well within retry_after_s
    assert store.list("runs/r/checkpoints/") == [
        "runs/r/checkpoints/step-40/MANIFEST.json",
        "runs/r/checkpoints/step-60/MANIFEST.json",
    ]
    assert not store.primary_down


def test_reads_the_twin_lacks_cost_no_requests_to_a_primary_that_is_still_down(
    partitioned: Any, tmp_path: Path
) -> None:
    """The slow e2e's run stalled in CI during its outage: with the primary presumed down, every
    read of a key the twin lacked (a new generation's records, a manifest not yet written)
    asked the primary again, through botocore's retries. A bare connection goes first now."""
    partition, primary = partitioned
    sent: list[str] = []
    primary._client.meta.events.register(
        "before-send.s3", lambda **kw: sent.append(kw["request"].url)
    )
    ticks = [0.0]
    store = TwinStore(
        primary, LocalStore(tmp_path / "twin"), probe_every_s=1, clock=lambda: ticks[0]
    )
    partition.cut()
    with pytest.raises(StoreUnavailable):
        store.get_bytes("runs/r/generations/gen-3.json")  # meets the outage
    assert sent and store.primary_down
    sent.clear()
    for tick in range(20):
        ticks[0] = 0.5 * tick
        with pytest.raises(StoreUnavailable):
            store.get_bytes("runs/r/generations/gen-3.json")
    assert sent == [] and not store.primary.reachable()
    partition.heal()
    primary.put_bytes("runs/r/generations/gen-3.json", b"since")
    ticks[0] += 1
    assert store.get_bytes("runs/r/generations/gen-3.json") == b"since"  # back: asked again


def test_code_snapshots_reach_the_twin(tmp_path: Path) -> None:
    """A run of a user's code that resumes from the twin fetches its code there."""
    primary, twin = LocalStore(tmp_path / "primary"), LocalStore(tmp_path / "twin")
    code = tmp_path / "code"
    code.mkdir()
    (code / "train.py").write_text("import forgeline\n")
    published = code_snapshot.publish(primary, code)
    Replicator(primary, twin, tmp_path / "scratch").run_once()
    fetched = code_snapshot.fetch(twin, published.snapshot_id, published.manifest_sha256,
                                  tmp_path / "fetched")  # fmt: skip
    assert (fetched / "train.py").read_text() == "import forgeline\n"


def test_the_replicator_reports_an_unreachable_primary_and_catches_up(
    partitioned: Any, tmp_path: Path
) -> None:
    partition, primary = partitioned
    twin = LocalStore(tmp_path / "twin")
    replicator = Replicator(primary, twin, tmp_path / "scratch")
    partition.cut()
    status = replicator.run_once()
    assert not status.primary_reachable and "cannot reach" in status.error
    assert not ReplicationStatus.read(twin).primary_reachable
    partition.heal()
    primary.put_bytes("runs/r/checkpoints/step-5/w", b"w")
    primary.put_if_absent("runs/r/checkpoints/step-5/MANIFEST.json", b"{}")
    status = replicator.run_once()
    assert status.primary_reachable and twin.exists("runs/r/checkpoints/step-5/MANIFEST.json")


class CutAfterManifest(LocalStore):
    """A twin whose primary drops off the network the moment a manifest lands on it: between
    the copy and the replicator's check that the checkpoint was not pruned meanwhile."""

    def __init__(self, root: Path, partition: Partition) -> None:
        super().__init__(root)
        self.partition = partition

    def put_if_absent(self, key: str, data: bytes) -> bool:
        landed = super().put_if_absent(key, data)
        self.partition.cut()
        return landed


def test_a_copy_confirmed_after_the_primary_returns_is_listed(
    partitioned: Any, tmp_path: Path
) -> None:
    """The e2e of the twin site cut the primary just as its first checkpoint reached the twin:
    that copy was on the twin but never in the status, and the run was missing from it."""
    partition, primary = partitioned
    manifest = checkpoint(primary, "r", 50)
    replicator = Replicator(primary, CutAfterManifest(tmp_path / "twin", partition), tmp_path)
    status = replicator.run_once()
    assert not status.primary_reachable and status.recent == []
    partition.heal()
    status = replicator.run_once()
    assert [entry.manifest_key for entry in status.recent] == [manifest]
    assert status.pending == []


def test_an_unreachable_primary_alone_is_an_error_that_names_it(partitioned: Any) -> None:
    partition, primary = partitioned
    partition.cut()
    with pytest.raises(StoreUnavailable, match="cannot reach the S3 endpoint"):
        primary.get_bytes("anything")


def test_open_store_with_a_twin_and_url_options(endpoint: str, bucket: str, tmp_path: Path) -> None:
    store = open_store(str(tmp_path / "p"), twin=f"s3://{bucket}/twin?endpoint={endpoint}")
    assert isinstance(store, TwinStore) and store.url == f"file://{tmp_path / 'p'}"
    assert store.twin_url == f"s3://{bucket}/twin?endpoint={endpoint}"
    store.twin.put_bytes("k", b"v")
    assert open_store(store.twin_url).get_bytes("k") == b"v"  # the URL reaches the same site


class PrunedWhileRead(LocalStore):
    """A primary whose checkpoint is pruned (on both sites, as TwinStore.delete does) just as
    the replicator has read its first object: the race of a prune with a copy in flight."""

    def __init__(self, root: Path, twin: LocalStore, folder: str) -> None:
        super().__init__(root)
        self.twin, self.folder, self.pruned = twin, folder, False

    def get_file(self, key: str, dest: Path) -> None:
        super().get_file(key, dest)
        if not self.pruned:
            self.pruned = True
            for pruned in self.list(self.folder):
                self.delete(pruned)
                if self.twin.exists(pruned):
                    self.twin.delete(pruned)


def test_a_copy_that_lands_after_its_checkpoint_was_pruned_is_taken_back(
    tmp_path: Path,
) -> None:
    twin = LocalStore(tmp_path / "twin")
    folder = "runs/r/checkpoints/step-100/"
    primary = PrunedWhileRead(tmp_path / "primary", twin, folder)
    checkpoint(primary, "r", 100)
    Replicator(primary, twin, tmp_path / "scratch").run_once()
    assert primary.pruned and primary.list(folder) == []
    assert twin.list(folder) == []  # neither the object copied after the prune nor a manifest


def test_resume_passes_over_a_checkpoint_whose_files_only_the_unreachable_primary_holds(
    partitioned: Any, tmp_path: Path
) -> None:
    """The slow twin e2e stalled in CI: the primary was cut while a checkpoint was being
    written, so a rank's file went to the primary and the manifest, after it, to the twin. Resume
    met that file on the primary alone and retried for the whole outage; it takes the newest
    checkpoint the twin holds whole instead, and says why it passed the newer one over."""
    partition, primary = partitioned
    twin = LocalStore(tmp_path / "twin")
    store = TwinStore(primary, twin, retry_after_s=30)
    commit(twin, "r", 50, generation=1)  # replicated before the outage
    split = commit(primary, "r", 100, generation=1)
    twin.put_bytes(split, primary.get_bytes(split))  # the manifest, written after the cut
    primary.delete(split)
    partition.cut()
    skipped: list[str] = []
    found = find_latest(store, "r", max_generation=2, on_skip=skipped.append)
    assert found is not None and found.step == 50
    file_key = f"{split.rsplit('/', 1)[0]}/__0_0.distcp"
    assert skipped == [
        f"{split}: {file_key} is not on the twin {twin.url} and the primary {primary.url} is "
        "down: it may be copied there, or the primary return, later"
    ]
    with pytest.raises(StoreUnavailable):  # NotOnTwin is an outage to those who wait it out
        store.get_bytes(file_key)
