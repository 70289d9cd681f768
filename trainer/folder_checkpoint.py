"""A script's checkpoint folder as a Forgeline checkpoint: copied whole, committed, restored.

A script that never imports Forgeline writes its checkpoints into a folder (`torch.save` to
`last.pt`, `step-300/` sub-folders, a temporary name renamed into place). The node agent
commits what is there (`trainer.folder_watch` decides when) in three steps, as every checkpoint
is committed:

1. `copy_snapshot`: each file the scan found (`trainer.folder_scan`) is copied into a staging
   folder of the agent's, hashed on the way. A hard link would not do: scripts overwrite in
   place, and the linked bytes would change under the upload. After the copies, every source
   must still have the stamp it had when scanned; otherwise the copy may hold one file from
   before a save and another from after it, and it is dropped (`TornSnapshot`).
2. `commit_snapshot`: every file is uploaded with its size and sha256 under this generation's
   checkpoint folder, then the manifest (`contents="folder"`) is put last through
   `commit_fenced`. A generation that a later one fenced uploads and commits nothing.
3. `restore_folder`: before a restarted gang starts, the last commit is fetched, every file
   checked by sha256, into a fresh folder that then takes the checkpoint folder's place.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import uuid
from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path, PurePosixPath
from typing import Any

from infra.store.protocol import ObjectStore, fetch_verified
from trainer.checkpoint_manifest import FOLDER_CONTENTS, CheckpointFile, CheckpointManifest
from trainer.errors import CheckpointError
from trainer.folder_scan import (
    FileStamp,
    FolderScan,
    NotTheScannedFile,
    ScannedFile,
    open_inside,
    scan_folder,
)
from trainer.manifest import (
    CommitOutcome,
    Fences,
    checkpoint_prefix,
    commit_fenced,
    delete_unless_fenced,
    manifest_key,
    prune,
)

_CHUNK = 1 << 20


class TornSnapshot(Exception):
    """The folder changed while it was copied: the copy is not one moment of it."""


@dataclass(frozen=True)
class StagedFile:
    name: str  # its path in the script's folder
    copy: Path  # the agent's copy, in staging
    bytes: int
    sha256: str


@dataclass(frozen=True)
class Snapshot:
    """The folder at one quiet moment, copied out of the script's reach."""

    files: list[StagedFile]
    signature: dict[str, FileStamp]  # the stamps the copies were taken at


def copy_snapshot(root: Path, scan: FolderScan, staging: Path) -> Snapshot:
    """Copy every file of `scan` into `staging` (a new folder, outside `root`), or raise
    TornSnapshot (and leave no staging behind) if any of them changed meanwhile."""
    staging.mkdir(parents=True)
    try:
        staged = [
            _copy_one(root, entry, staging / str(index))  # staged by number: no name of theirs
            for index, entry in enumerate(scan.files.values())
        ]
        before, after = scan.signature(), scan_folder(root).signature()
        if after != before:  # written, replaced, added or removed while we copied
            changed = sorted(n for n in before | after if before.get(n) != after.get(n))
            raise TornSnapshot(f"written while it was copied: {', '.join(changed[:5])}")
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return Snapshot(staged, scan.signature())


def _copy_one(root: Path, entry: ScannedFile, copy: Path) -> StagedFile:
    try:
        fd = open_inside(root, entry)
    except NotTheScannedFile as err:
        raise TornSnapshot(str(err)) from None
    digest, copied = hashlib.sha256(), 0
    with os.fdopen(fd, "rb") as source, open(copy, "wb") as target:
        while chunk := source.read(_CHUNK):
            digest.update(chunk)
            target.write(chunk)
            copied += len(chunk)
        if copied != entry.stamp.size or FileStamp.of(os.fstat(fd)) != entry.stamp:
            raise TornSnapshot(f"{entry.name}: written while it was copied")
    return StagedFile(entry.name, copy, copied, digest.hexdigest())


@dataclass(frozen=True)
class CommitTarget:
    """Whose checkpoint a commit is: the run and the generation that writes it."""

    run_id: str
    generation: int
    run_uid: str = ""


@dataclass(frozen=True)
class FolderCommit:
    step: int
    key: str  # where the manifest is (or would have been)
    outcome: CommitOutcome | None  # None: fenced before anything was uploaded

    @property
    def fenced(self) -> bool:
        """A later generation has started: this one commits nothing more."""
        return self.outcome in (None, CommitOutcome.TAKEN_BACK)


def commit_snapshot(
    store: ObjectStore,
    snapshot: Snapshot,
    target: CommitTarget,
    step: int,
    meta: dict[str, Any] | None = None,
    keep: int | None = None,
    verified: set[str] | None = None,
) -> FolderCommit:
    """Upload the snapshot's files and put its manifest last, fenced by generation. `meta`:
    more of the manifest's fields (tokens_seen, world_size, ...); `keep`: prune the run to
    that many checkpoints after a commit (`verified`: prune's cache across commits)."""
    key = manifest_key(target.run_id, step, target.generation)
    if Fences.read(store, target.run_id, target.run_uid).superseded(target.generation):
        return FolderCommit(step, key, None)
    # Every commit uploads all its files, the unchanged ones again: a manifest could name files
    # under an earlier step's folder, but pruning deletes a checkpoint's folder whole
    # (trainer.manifest.prune), and would take them from the newer checkpoint that names them.
    # Within a commit, a file is stored once by its sha256, so names never have to be keys.
    prefix = checkpoint_prefix(target.run_id, step, target.generation)
    uploaded: dict[str, str] = {}
    for staged in snapshot.files:
        if staged.sha256 not in uploaded:
            uploaded[staged.sha256] = f"{prefix}/files/{staged.sha256}"
            store.put_file(uploaded[staged.sha256], staged.copy)
    files = [
        CheckpointFile(name=s.name, key=uploaded[s.sha256], bytes=s.bytes, sha256=s.sha256)
        for s in snapshot.files
    ]
    manifest = CheckpointManifest.model_validate(
        {
            **(meta or {}),
            "run_id": target.run_id,
            "run_uid": target.run_uid,
            "step": step,
            "generation": target.generation,
            "committed_at": datetime.now(UTC).isoformat(),
            "contents": FOLDER_CONTENTS,
            "files": files,
        }
    )
    outcome = commit_fenced(
        store, key, manifest, target.run_id, target.run_uid, target.generation, step
    )
    if outcome is CommitOutcome.TAKEN_BACK:
        delete_unless_fenced(store, uploaded.values())
    # ALREADY_THERE: another writer of this generation committed this step; its files are at
    # the same content-named keys, so none of ours are deleted.
    if outcome is CommitOutcome.COMMITTED and keep is not None:
        prune(store, target.run_id, keep, verified, target.run_uid)
    return FolderCommit(step, key, outcome)


@dataclass(frozen=True)
class RestoredFolder:
    """What a restarted script is told: its folder holds the checkpoint of `step`."""

    path: Path
    step: int
    generation: int  # the generation that committed it
    files: int
    bytes: int


def restore_folder(
    store: ObjectStore,
    manifest: CheckpointManifest,
    dest: Path,
    only: Collection[str] | None = None,
) -> RestoredFolder:
    """Make `dest` the folder checkpoint `manifest` commits, every file checked by sha256: it is
    fetched into a fresh folder beside `dest`, which then takes its place (what was in `dest`
    is removed). A file that does not verify raises IntegrityError and leaves `dest` as it was.
    `only`: the names of the files to fetch (registration takes those the spec names)."""
    if manifest.contents != FOLDER_CONTENTS:
        raise CheckpointError(
            f"checkpoint of step {manifest.step} holds {manifest.contents!r} files, not a "
            "script's folder: it is resumed through the SDK"
        )
    names = _checked_names([entry.name for entry in manifest.files])
    incoming = _new_folder_beside(dest)
    try:
        for name, entry in zip(names, manifest.files, strict=True):
            if only is not None and entry.name not in only:
                continue
            local = incoming.joinpath(*name.parts)
            local.parent.mkdir(parents=True, exist_ok=True)
            fetch_verified(store, entry.key, local, entry.sha256, entry.bytes)
        _take_place(incoming, dest)
    except BaseException:
        shutil.rmtree(incoming, ignore_errors=True)
        raise
    fetched = [e for e in manifest.files if only is None or e.name in only]
    size = sum(entry.bytes for entry in fetched)
    return RestoredFolder(dest, manifest.step, manifest.generation, len(fetched), size)


def clear_folder(dest: Path) -> None:
    """Make `dest` an empty folder, for a gang that has no commit to start from: what a gang
    killed before its first commit left there (a file torn by the kill) is no checkpoint."""
    _take_place(_new_folder_beside(dest), dest)


def _new_folder_beside(dest: Path) -> Path:
    """A new folder on `dest`'s disk, so that it can take `dest`'s place by a rename."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    folder = dest.parent / f".{dest.name}.restoring-{uuid.uuid4().hex[:8]}"
    folder.mkdir()
    return folder


def _checked_names(names: list[str]) -> list[PurePosixPath]:
    """The manifest's names as paths that stay inside the folder (a manifest is read from the
    store, and a crafted one could name ../../.bashrc), none of them both a file and a folder."""
    paths = []
    for name in names:
        path = PurePosixPath(name)
        if (
            not name
            or path.is_absolute()
            or str(path) != name  # no '//', no trailing '/', no './'
            or any(part in (".", "..") for part in path.parts)
            or "\0" in name
        ):
            raise CheckpointError(f"refusing checkpoint file name {name!r}: not a path inside it")
        paths.append(path)
    folders = {str(parent) for path in paths for parent in path.parents}
    twice = {name for name, count in Counter(names).items() if count > 1}
    if clashes := sorted(twice | (set(names) & folders)):
        raise CheckpointError(
            f"checkpoint file names clash (twice, or both a file and a folder): {clashes}"
        )
    return paths


def _take_place(incoming: Path, dest: Path) -> None:
    """Rename `incoming` to `dest`, moving what was there aside first. A crash between the two
    renames leaves no `dest`; the next start restores again, before any rank runs."""
    if not os.path.lexists(dest):
        os.rename(incoming, dest)
        return
    replaced = dest.with_name(f".{dest.name}.replaced-{uuid.uuid4().hex[:8]}")
    os.rename(dest, replaced)
    os.rename(incoming, dest)
    if replaced.is_symlink() or not replaced.is_dir():  # a script may have left a link there
        replaced.unlink()
    else:
        shutil.rmtree(replaced)
