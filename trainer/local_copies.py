"""A node's own copies of the checkpoint its ranks committed last.

When a gang fails, most of its nodes survive, and each of them wrote its ranks' shards of the
last checkpoint itself. The ranks keep those files here (by sha256, the name the manifest
gives them) instead of deleting them after the upload; the next generation on this node takes
them from here, each checked against the manifest again, and reads from the store only what
the node lacks: the dead node's shards, the shards of ranks now placed elsewhere, or a copy that
no longer verifies.

One folder a node, for whichever run its ranks train: a node runs one job at a time, and only
the newest commit's files are kept (the node-local rank 0 prunes the others after each commit;
every rank knows the commit's whole file list from the commit's own all-gather).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

from infra.digest import is_sha256_hex, sha256_file
from trainer.checkpoint_manifest import CheckpointFile


class LocalCopies:
    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.served_bytes = 0  # placed from here since this object was made: what a fetch saved

    def _path(self, sha256: object) -> Path | None:
        return self.folder / sha256 if is_sha256_hex(sha256) else None

    def keep(self, written: list[tuple[Path, str]]) -> None:
        """Move files this rank wrote and committed (path, sha256) here: a rename on the same
        disk, so keeping them costs no copy."""
        self.folder.mkdir(parents=True, exist_ok=True)
        for path, sha256 in written:
            kept = self._path(sha256)
            if kept is not None:
                os.replace(path, kept)

    def hold(self, sha256: str, data: bytes) -> None:
        """Keep a copy another node sent (the caller has checked its sha256): written aside,
        then renamed, so a half-written copy never carries the name."""
        kept = self._path(sha256)
        if kept is None:
            raise ValueError(f"not a sha256: {sha256!r}")
        self.folder.mkdir(parents=True, exist_ok=True)
        partial = kept.with_name(f"{sha256}.partial")
        partial.write_bytes(data)
        os.replace(partial, kept)

    def holds(self, entry: CheckpointFile) -> bool:
        """A copy of the entry is here (not yet verified: `place` does that)."""
        kept = self._path(entry.sha256)
        return kept is not None and kept.is_file()

    def prune(self, wanted: set[str]) -> None:
        """Delete every copy that is not one of `wanted` (the newest commit's files)."""
        if not self.folder.is_dir():
            return
        for path in self.folder.iterdir():
            if path.name not in wanted:
                with contextlib.suppress(FileNotFoundError):  # another rank's prune
                    path.unlink()

    def place(self, entry: CheckpointFile, dest: Path) -> bool:
        """Put this node's copy of a manifest entry at `dest` if it has one that verifies
        (size and sha256): a hard link, so it costs no copy either. A copy that does not
        verify is deleted. False: the store must provide it."""
        kept = self._path(entry.sha256)
        if kept is None or not kept.is_file():
            return False
        if kept.stat().st_size != entry.bytes or sha256_file(kept) != entry.sha256:
            kept.unlink(missing_ok=True)
            return False
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.unlink(missing_ok=True)
        try:
            os.link(kept, dest)
        except OSError:  # another file system: a copy
            shutil.copyfile(kept, dest)
        self.served_bytes += entry.bytes
        return True
