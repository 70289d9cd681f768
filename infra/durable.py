"""Writes that survive a power cut: data first, then the name, both on the disk.

A rename is atomic for readers but lives in the page cache like any other change: after a
crash the folder may still name the old file (or, without the data's fsync, a new name may
point at empty blocks). So a replacement fsyncs the new file's data before the rename and the
folder after it; only then has the change happened. The local store (`infra/store/local.py`)
and the state folder's small records (`infra/tokens.py`: tokens, logins, node claims) both
write this way.
"""

from __future__ import annotations

import os
from pathlib import Path


def fsync_path(path: Path) -> None:
    """Flush a file's data, or a folder's entries, from the page cache to the disk."""
    fd = os.open(path, os.O_RDONLY)  # read-only suffices: fsync flushes the inode, not the fd
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_durably(tmp: Path, final: Path) -> None:
    """Rename a written temporary file into place: data first, then the name, both durable."""
    fsync_path(tmp)
    os.replace(tmp, final)
    fsync_path(final.parent)
