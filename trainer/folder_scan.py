"""What a script's checkpoint folder holds right now, and whether anyone is still writing it.

A script that never imports Forgeline writes its checkpoints into a folder the node agent
watches (`trainer.folder_watch`). Before the agent copies anything out of it, it must know two
things this module answers: which files there may be committed at all, and whether the script
is done with them.

What may be committed: regular files, and links to regular files inside the folder (taken as
copies of their target; Lightning keeps `last.ckpt` as such a link). A user's script is hostile
until checked, and the agent reads as root: a link out of the folder (to /etc/shadow), a link to
a folder, a device file, a FIFO or a socket is never read, only named in `skipped`. The check is
made again on the opened file (`open_inside`), so a link swapped in after the scan changes
nothing.

Whether the script is done: `open_for_writing` looks through every process's open files
(/proc/<pid>/fd, and the access mode in /proc/<pid>/fdinfo) for one of the folder's files held
open for writing. Files are matched by device and inode, not by path, so a rank in a box of its
own (another mount namespace, where the folder has another path) is found as well.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class FileStamp:
    """What changes when a file is written or replaced: the copy is taken only if it is the
    same before and after. (ctime too: a script can set mtime back, never ctime.)"""

    device: int
    inode: int
    size: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of(cls, status: os.stat_result) -> FileStamp:
        return cls(
            status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns, status.st_ctime_ns
        )


@dataclass(frozen=True)
class ScannedFile:
    name: str  # its path in the folder, '/'-separated: the name the manifest gives it
    path: Path
    stamp: FileStamp
    linked: bool  # a link inside the folder: its target's bytes are taken under this name


@dataclass(frozen=True)
class FolderScan:
    files: dict[str, ScannedFile]
    skipped: dict[str, str] = field(default_factory=dict)  # name: why it is not committed

    def signature(self) -> dict[str, FileStamp]:
        """What the folder looked like: equal signatures, nothing written in between."""
        return {name: entry.stamp for name, entry in self.files.items()}


def scan_folder(root: Path) -> FolderScan:
    """Every file of `root` that may be committed, and every entry that may not, with why."""
    real_root = os.path.realpath(root)
    files: dict[str, ScannedFile] = {}
    skipped: dict[str, str] = {}
    for path, name in _entries(Path(root)):
        if not _plain_text(name):
            skipped[repr(name)] = "its name is not UTF-8 text"
            continue
        try:
            found = os.lstat(path)
            linked = stat.S_ISLNK(found.st_mode)
            if linked:
                why = _why_not_followed(real_root, path)
                if why:
                    skipped[name] = why
                    continue
                found = os.stat(path)
        except OSError:  # deleted since the listing: the next scan sees the change
            continue
        if not stat.S_ISREG(found.st_mode):
            skipped[name] = f"not a regular file ({_kind(found.st_mode)})"
            continue
        files[name] = ScannedFile(name, path, FileStamp.of(found), linked)
    return FolderScan(files, skipped)


def _entries(root: Path) -> Iterator[tuple[Path, str]]:
    """Every entry below `root` but its sub-folders, with its '/'-separated name; never
    through a link (a link to a folder is an entry, refused by the scan). A loop, not
    recursion: a script may nest folders deeper than Python's stack."""
    folders = [(root, "")]
    while folders:
        folder, prefix = folders.pop()
        try:
            listing = sorted(os.scandir(folder), key=lambda e: e.name)
        except OSError:  # removed while we walked it (or, to an agent not root, unreadable)
            continue
        for entry in listing:
            name = f"{prefix}{entry.name}"
            if entry.is_dir(follow_symlinks=False):
                folders.append((Path(entry.path), f"{name}/"))
            else:
                yield Path(entry.path), name


def _plain_text(name: str) -> bool:
    try:
        name.encode()
    except UnicodeEncodeError:  # bytes that are not UTF-8 come back as lone surrogates
        return False
    return True


def _why_not_followed(real_root: str, link: Path) -> str | None:
    target = os.path.realpath(link)
    if not _inside(real_root, target):
        return f"a link out of the folder (to {target})"
    if not os.path.isfile(target):
        return f"a link to something that is not a regular file ({target})"
    return None


def _inside(real_root: str, real_path: str) -> bool:
    return real_path.startswith(real_root.rstrip("/") + "/")


def _kind(mode: int) -> str:
    kinds = {stat.S_ISDIR: "a folder", stat.S_ISFIFO: "a FIFO", stat.S_ISSOCK: "a socket",
             stat.S_ISCHR: "a character device", stat.S_ISBLK: "a block device"}  # fmt: skip
    return next((what for test, what in kinds.items() if test(mode)), "unknown")


class NotTheScannedFile(Exception):
    """The file at a scanned name is no longer the one scanned, or is not one we may read."""


def open_inside(root: Path, entry: ScannedFile) -> int:
    """An open descriptor of the scanned file, checked on the opened file itself: a regular
    file inside `root`, with the stamp the scan saw. Non-blocking, so a FIFO swapped in cannot
    hang the agent; a link is followed only where the scan found one."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if entry.linked else os.O_NOFOLLOW)
    try:
        fd = os.open(entry.path, flags)
    except OSError as err:
        raise NotTheScannedFile(f"{entry.name}: cannot be opened ({err.strerror})") from None
    try:
        status = os.fstat(fd)
        where = os.readlink(f"/proc/self/fd/{fd}")
        if not stat.S_ISREG(status.st_mode) or not _inside(os.path.realpath(root), where):
            raise NotTheScannedFile(f"{entry.name}: now {where}, not a file of the folder")
        if FileStamp.of(status) != entry.stamp:
            raise NotTheScannedFile(f"{entry.name}: written or replaced since the scan")
    except BaseException:
        os.close(fd)
        raise
    return fd


@dataclass(frozen=True)
class Writer:
    pid: int
    name: str  # the folder's file it holds open for writing


def open_for_writing(scan: FolderScan, proc: Path = Path("/proc")) -> list[Writer]:
    """The processes that hold one of the scanned files open for writing (write-only or
    read-write). Processes and descriptors that vanish while we look are passed over; so are
    those we may not inspect (only root sees every process's descriptors)."""
    wanted = {(e.stamp.device, e.stamp.inode): name for name, e in scan.files.items()}
    if not wanted:
        return []
    writers = []
    for pid in (int(p) for p in os.listdir(proc) if p.isdigit()):
        for fd in _descriptors(proc / str(pid)):
            with contextlib.suppress(OSError):  # closed, or the process gone, since listed
                status = os.stat(proc / str(pid) / "fd" / fd)
                name = wanted.get((status.st_dev, status.st_ino))
                if name is not None and _writable(proc / str(pid) / "fdinfo" / fd):
                    writers.append(Writer(pid, name))
    return writers


def _descriptors(process: Path) -> list[str]:
    try:
        return os.listdir(process / "fd")
    except OSError:  # gone, a kernel thread's, or not ours to read
        return []


def _writable(fdinfo: Path) -> bool:
    """Whether the descriptor was opened for writing: `flags:` in fdinfo is the open flags in
    octal, and O_ACCMODE's bits of it the access mode."""
    for line in fdinfo.read_text().splitlines():
        if line.startswith("flags:"):
            return int(line.split()[1], 8) & os.O_ACCMODE in (os.O_WRONLY, os.O_RDWR)
    return False
