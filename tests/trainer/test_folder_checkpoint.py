"""A script's checkpoint folder, committed by the node agent and restored for the next gang:
against a real local store, with real processes writing, and files a hostile script plants."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from infra.digest import sha256_bytes
from infra.errors import IntegrityError
from infra.store.local import LocalStore
from infra.store.protocol import verify_stored_files
from trainer.checkpoint_manifest import CheckpointFile, CheckpointManifest
from trainer.errors import CheckpointError
from trainer.folder_checkpoint import (
    CommitTarget,
    TornSnapshot,
    clear_folder,
    copy_snapshot,
    restore_folder,
)
from trainer.folder_scan import scan_folder
from trainer.folder_watch import FolderPoll, FolderState, FolderWatcher
from trainer.manifest import find_latest, record_generation

RUN = "folder-run"
# Committed by this build's FolderWatcher: folder manifests written from now on must keep loading.
STORED = Path(__file__).parent / "stored" / "folder-checkpoint-manifest-v1.json"
SETTLE_S = 0.05


class RecordingStore(LocalStore):
    """A real local store that remembers the order of its puts."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.puts: list[str] = []

    def put_file(self, key: str, path: Path) -> None:
        super().put_file(key, path)
        self.puts.append(key)

    def put_if_absent(self, key: str, data: bytes) -> bool:
        self.puts.append(key)
        return super().put_if_absent(key, data)


@pytest.fixture
def store(tmp_path: Path) -> RecordingStore:
    store = RecordingStore(tmp_path / "store")
    record_generation(store, RUN, 1, resume_step=0)
    return store


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    (tmp_path / "ckpt").mkdir()
    return tmp_path / "ckpt"


def watch(
    store: LocalStore,
    folder: Path,
    generation: int = 1,
    last_step: int = 0,
    keep: int | None = None,
) -> FolderWatcher:
    staging = folder.parent / f"staging-{generation}"
    target = CommitTarget(RUN, generation)
    return FolderWatcher(folder, staging, store, target, last_step, settle_s=SETTLE_S, keep=keep)


def poll_until(watcher: FolderWatcher, *states: FolderState, within_s: float = 3.0) -> FolderPoll:
    deadline = time.monotonic() + within_s
    while (polled := watcher.poll()).state not in states:
        assert time.monotonic() < deadline, f"still {polled.state}: {polled.why}"
        time.sleep(SETTLE_S / 5)
    return polled


def committed(store: LocalStore, generation: int = 1) -> CheckpointManifest:
    found = find_latest(store, RUN, max_generation=generation)
    assert found is not None
    return found.manifest


def files_of(root: Path) -> dict[str, bytes]:
    return {
        path.relative_to(root).as_posix(): path.read_bytes()
        for path in sorted(root.rglob("*"))
        if path.is_file()
    }


def test_a_quiet_folder_is_committed_with_its_manifest_last_and_verifies(
    store: RecordingStore, folder: Path
) -> None:
    watcher = watch(store, folder, keep=1)
    store.puts.clear()  # the generation's fence
    (folder / "step-300").mkdir()
    (folder / "step-300" / "model.pt").write_bytes(os.urandom(50_000))
    (folder / "last.pt.tmp").write_bytes(b"weights at 300")
    (folder / "last.pt.tmp").rename(folder / "last.pt")  # the usual write-then-rename
    (folder / "copy-of-last.pt").write_bytes(b"weights at 300")  # the same bytes, stored once

    polled = poll_until(watcher, FolderState.COMMITTED)

    assert polled.commit is not None and polled.commit.step == 1
    assert (
        store.puts[-1] == polled.commit.key == f"runs/{RUN}/checkpoints/step-1/gen-1/MANIFEST.json"
    )
    assert len(store.puts) == 3  # two distinct contents, then the manifest
    manifest = committed(store)
    assert manifest.contents == "folder" and manifest.step == 1
    assert {f.name: f.sha256 for f in manifest.files} == {
        name: sha256_bytes(data) for name, data in files_of(folder).items()
    }
    verify_stored_files(store, manifest.files, "checkpoint file")
    assert watcher.poll().state is FolderState.UNCHANGED  # nothing is committed twice

    (folder / "last.pt").write_bytes(b"weights at 400, longer")
    polled = poll_until(watcher, FolderState.COMMITTED)
    assert polled.commit is not None and committed(store).step == 2
    kept = store.list(f"runs/{RUN}/checkpoints/")
    assert kept and all("/step-2/gen-1/" in key for key in kept)  # pruned with its files


CHILD = """
import sys
with open(sys.argv[1], "wb") as out:
    out.write(b"a" * 65536)
    out.flush()
    print("half", flush=True)
    sys.stdin.readline()  # holds the file open, writing nothing, until told to go on
    out.write(b"b" * 65536)
"""


def test_a_file_another_process_is_still_writing_is_never_committed_half(
    store: LocalStore, folder: Path
) -> None:
    watcher = watch(store, folder)
    writer = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(folder / "model.pt")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert writer.stdout is not None and writer.stdout.readline() == "half\n"
        # Quiet for many settle periods, but the file is held open for writing.
        states = set()
        deadline = time.monotonic() + 6 * SETTLE_S
        while time.monotonic() < deadline:
            polled = watcher.poll()
            states.add(polled.state)
            if polled.state is FolderState.BUSY:
                assert f"model.pt (pid {writer.pid})" in polled.why
            time.sleep(SETTLE_S / 5)
        assert FolderState.BUSY in states and FolderState.COMMITTED not in states
        assert find_latest(store, RUN, max_generation=1) is None
    finally:
        writer.communicate("go on\n", timeout=10)
    assert writer.returncode == 0

    poll_until(watcher, FolderState.COMMITTED)
    (entry,) = committed(store).files
    assert (
        entry.sha256
        == sha256_bytes(b"a" * 65536 + b"b" * 65536)
        == sha256_bytes((folder / "model.pt").read_bytes())
    )


@pytest.mark.parametrize("how", ["rewritten in place", "replaced by a rename", "added"])
def test_a_folder_written_between_scan_and_copy_is_torn_and_not_committed(
    store: LocalStore, folder: Path, how: str
) -> None:
    (folder / "last.pt").write_bytes(b"step 300")
    scan = scan_folder(folder)
    if how == "rewritten in place":
        (folder / "last.pt").write_bytes(b"step 400, half written")
    elif how == "replaced by a rename":
        (folder / "next.pt").write_bytes(b"step 400")
        (folder / "next.pt").rename(folder / "last.pt")
    else:
        (folder / "optimizer.pt").write_bytes(b"the other half of step 300")
    staging = folder.parent / "staging"

    with pytest.raises(TornSnapshot):
        copy_snapshot(folder, scan, staging)
    assert not staging.exists()
    assert store.list(f"runs/{RUN}/checkpoints/") == []


def test_a_fenced_generation_commits_nothing_once_a_newer_one_has_started(
    store: LocalStore, folder: Path
) -> None:
    old = watch(store, folder, generation=1)
    (folder / "last.pt").write_bytes(b"old generation, step 1")
    record_generation(store, RUN, 2, resume_step=0)  # a new gang has started from scratch

    assert poll_until(old, FolderState.FENCED).commit is not None
    assert store.list(f"runs/{RUN}/checkpoints/") == []  # not even a file was uploaded
    assert old.poll().state is FolderState.FENCED and old.final().state is FolderState.FENCED

    new = watch(store, folder, generation=2)
    (folder / "last.pt").write_bytes(b"new generation, step 1")
    assert new.final().state is FolderState.COMMITTED
    assert committed(store, generation=2).generation == 2


def test_each_manifest_carries_the_fields_its_sources_give_at_its_commit(
    store: LocalStore, folder: Path
) -> None:
    """The watcher's own fields, then those added later (a script's reports), asked again at
    every commit: a later source's field stands over an earlier one's."""
    reported: list[tuple[int, float]] = []
    watcher = FolderWatcher(
        folder, folder.parent / "staging", store, CommitTarget(RUN, 1), 0,
        meta=lambda: {"world_size": 2, "loss_history": [(0, 9.0)]},
    )  # fmt: skip
    watcher.add_meta(lambda: {"loss_history": list(reported)})
    reported.append((1, 4.0))
    (folder / "last.pt").write_bytes(b"step 1")
    assert watcher.final().state is FolderState.COMMITTED
    assert (committed(store).world_size, committed(store).loss_history) == (2, [(1, 4.0)])

    reported.append((2, 3.0))
    (folder / "last.pt").write_bytes(b"step 2")
    assert watcher.final().state is FolderState.COMMITTED
    assert committed(store).loss_history == [(1, 4.0), (2, 3.0)]


def test_restore_reproduces_the_folder_and_refuses_a_flipped_byte(
    store: LocalStore, folder: Path, tmp_path: Path
) -> None:
    watcher = watch(store, folder, last_step=299)
    (folder / "step-300" / "shards").mkdir(parents=True)
    (folder / "step-300" / "shards" / "rank-0.pt").write_bytes(os.urandom(70_000))
    (folder / "last.pt").write_bytes(os.urandom(1000))
    (folder / "empty").write_bytes(b"")
    assert watcher.final().state is FolderState.COMMITTED
    manifest = committed(store)
    assert manifest.step == 300  # the commits count on from the step resumed

    # The next gang's node, where the folder holds what a torn run left.
    dest = tmp_path / "node-2" / "ckpt"
    dest.mkdir(parents=True)
    (dest / "last.pt").write_bytes(b"torn")
    restored = restore_folder(store, manifest, dest)
    assert files_of(dest) == files_of(folder)
    assert (restored.path, restored.step, restored.files) == (dest, 300, 3)
    assert sorted(p.name for p in dest.parent.iterdir()) == ["ckpt"]  # nothing left beside it
    resumed = watch(store, dest, last_step=restored.step)
    assert resumed.poll().state is FolderState.UNCHANGED  # the restore itself is not a commit

    flipped = store.root / next(f.key for f in manifest.files if f.name == "last.pt")
    data = bytearray(flipped.read_bytes())
    data[500] ^= 0x01
    flipped.write_bytes(bytes(data))
    before = files_of(dest)
    with pytest.raises(IntegrityError, match="corrupt"):
        restore_folder(store, manifest, dest)
    assert files_of(dest) == before  # the folder is as it was, no half restore
    assert sorted(p.name for p in dest.parent.iterdir()) == ["ckpt"]
    clear_folder(dest)  # a gang with no commit to start from starts from nothing
    assert list(dest.iterdir()) == []


def test_restore_refuses_a_name_that_leaves_the_folder(store: LocalStore, tmp_path: Path) -> None:
    escape = CheckpointFile(name="../../.bashrc", key="runs/x/f", bytes=1, sha256="0" * 64)
    crafted = CheckpointManifest(step=1, generation=1, contents="folder", files=[escape])
    with pytest.raises(CheckpointError, match="not a path inside it"):
        restore_folder(store, crafted, tmp_path / "dest")
    sdk = CheckpointManifest(step=1, generation=1, files=[])
    with pytest.raises(CheckpointError, match="'dcp'"):
        restore_folder(store, sdk, tmp_path / "dest")


def test_links_out_of_the_folder_devices_fifos_and_sockets_are_never_uploaded(
    store: LocalStore, folder: Path, tmp_path: Path
) -> None:
    watcher = watch(store, folder)
    secret = tmp_path / "secret"
    secret.write_bytes(b"root:$6$hash-of-the-root-password")
    (folder / "model.pt").write_bytes(b"weights")
    (folder / "last.pt").symlink_to("model.pt")  # inside: committed as a copy of its target
    (folder / "shadow").symlink_to("/etc/shadow")
    (folder / "stolen.pt").symlink_to(secret)
    (folder / "up").symlink_to(tmp_path)  # a link to a folder is not walked
    os.mkfifo(folder / "pipe")
    with socket.socket(socket.AF_UNIX) as listening:
        listening.bind(str(folder / "sock"))
        polled = watcher.final()

    assert polled.state is FolderState.COMMITTED
    assert {f.name for f in committed(store).files} == {"model.pt", "last.pt"}
    assert "out of the folder" in polled.skipped["stolen.pt"]
    assert "out of the folder" in polled.skipped["shadow"]
    assert set(polled.skipped) == {"shadow", "stolen.pt", "up", "pipe", "sock"}
    stored = [(store.root / key).read_bytes() for key in store.list("runs/")]
    assert secret.read_bytes() not in stored and b"weights" in stored


def test_a_stored_folder_manifest_loads_and_writes_back_unchanged() -> None:
    key = "runs/plain-ddp/checkpoints/step-2/gen-3/MANIFEST.json"
    manifest = CheckpointManifest.parse(STORED.read_bytes(), key)
    assert (manifest.contents, manifest.step, manifest.generation) == ("folder", 2, 3)
    assert [f.name for f in manifest.files] == ["last.pt", "step-2/model.pt", "step-2/optimizer.pt"]
    assert json.loads(manifest.dump_bytes()) == json.loads(STORED.read_bytes())
    sdk = CheckpointManifest(step=1, generation=1, files=[])
    assert "contents" not in sdk.dump()  # the SDK's manifests say what they always said
