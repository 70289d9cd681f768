"""Object store: a flat key space with create-if-absent puts (S3: see infra/store/s3.py).

The local store keeps objects as files under a root folder; every write lands in a temporary
file first and is renamed into place, so a reader never sees half an object and a process killed
mid-write leaves no torn key behind. `put_if_absent` is the primitive that commits manifests: it
uses a hard link, which the kernel creates atomically or refuses when the name exists.

A write returns only once it is durable: the temporary file's data is fsynced before its rename
or link, and then the folder, so that the new name survives a power cut too. Without that, a
manifest could commit (and the checkpoint before it be deleted) while the files it names, or its
own name, still sat in the page cache: a crash then left a torn newest checkpoint and no older
one to fall back to. Callers order their writes (files, then manifest, then deletes); the store
makes each one stick before the next begins.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from infra.digest import sha256_file
from infra.durable import fsync_path, replace_durably
from infra.errors import ObjectNotFound
from infra.store.protocol import TMP_PREFIX, validate_key


class LocalStore:
    """An object store in a local folder (the local stack's stand-in for a bucket)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root).resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        self.url = f"file://{self.root}"

    def _path(self, key: str) -> Path:
        return self.root / validate_key(key)

    def _staged(self, key: str) -> Path:
        """A temporary file next to the key's final place, so the rename stays on one disk."""
        final = self._path(key)
        while True:
            try:
                self._make_folders(final.parent)
                fd, tmp = tempfile.mkstemp(prefix=TMP_PREFIX, dir=final.parent)
            except FileNotFoundError:  # a concurrent delete pruned the empty folder: again
                continue
            os.close(fd)
            return Path(tmp)

    def _make_folders(self, folder: Path) -> None:
        """Create `folder` and the missing ones above it, each made durable in its parent: a
        file's name survives a crash only if every folder on its path does."""
        missing = []
        while not folder.is_dir():
            missing.append(folder)
            folder = folder.parent
        for new in reversed(missing):
            new.mkdir(exist_ok=True)
            fsync_path(new.parent)

    def put_bytes(self, key: str, data: bytes) -> None:
        tmp = self._staged(key)
        tmp.write_bytes(data)
        replace_durably(tmp, self._path(key))

    def put_file(self, key: str, path: Path) -> None:
        tmp = self._staged(key)
        shutil.copyfile(path, tmp)
        replace_durably(tmp, self._path(key))

    def put_if_absent(self, key: str, data: bytes) -> bool:
        """Write `data` under `key` only if nothing is there; True when this call created it."""
        tmp, final = self._staged(key), self._path(key)
        try:
            tmp.write_bytes(data)
            fsync_path(tmp)  # the link must never name data that a crash could still take back
            os.link(tmp, final)
        except FileExistsError:
            return False
        finally:
            tmp.unlink(missing_ok=True)
        fsync_path(final.parent)  # the commit counts from here: its name is on the disk
        return True

    def get_bytes(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            raise ObjectNotFound(f"no object at {self.url}/{key}") from None

    def get_file(self, key: str, dest: Path) -> None:
        source = self._path(key)
        if not source.is_file():
            raise ObjectNotFound(f"no object at {self.url}/{key}")
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f"{TMP_PREFIX}{dest.name}-{os.getpid()}")
        shutil.copyfile(source, tmp)
        os.replace(tmp, dest)

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def digest(self, key: str) -> tuple[int, str]:
        """(size, sha256) of a stored object, computed without copying it out."""
        path = self._path(key)
        if not path.is_file():
            raise ObjectNotFound(f"no object at {self.url}/{key}")
        return path.stat().st_size, sha256_file(path)

    def claimed_digest(self, key: str) -> tuple[int, str]:
        """A folder keeps no claims beside the bytes: the digest of the bytes themselves."""
        return self.digest(key)

    def list(self, prefix: str) -> list[str]:
        """Every key that starts with `prefix` (a folder-like prefix ending in '/')."""
        base = self.root / validate_key(prefix.rstrip("/")) if prefix.strip("/") else self.root
        if not base.is_dir():
            return []
        keys = []
        for path in base.rglob("*"):
            if path.is_file() and not path.name.startswith(TMP_PREFIX):
                keys.append(path.relative_to(self.root).as_posix())
        return sorted(keys)

    def delete(self, key: str) -> None:
        path = self._path(key)
        path.unlink(missing_ok=True)
        # Folders are an artefact of this store, not objects: drop the ones left empty, as a
        # bucket has no empty "folders" either.
        for parent in path.parents:
            if parent == self.root:
                break
            try:
                parent.rmdir()
            except OSError:  # not empty (or already gone)
                break

    def reachable(self) -> bool:
        return self.root.is_dir()  # a folder: there, or its disk is gone
