"""Binds added to a box that is already running (infra.sandbox): what lets a node agent's warm
standby (trainer.warm_launch), made in a box that shows nothing of any run, become the torchrun
of whichever run comes next.

A box's binds are bwrap's to make when the box starts, and a node cannot know then which run
its next job will be: a spare that replaces a dead node never trained the run before. So the
standby starts in the part every job's box has in common (the Python environment, Forgeline's
packages, the GPU files every
job needs), and before it is handed a job, a helper process adds the job's own binds
inside it with Linux's mount API:

- `open_tree(OPEN_TREE_CLONE)` copies each host path's mount, detached, and `mount_setattr`
  makes the copy read-only (and nosuid, nodev) where the box shows it read-only;
- `setns` enters the box's mount namespace, where the mount point is made in the box's own
  root, and `move_mount` attaches the copy there.

After that the box shows exactly what a box started with those binds shows (the test compares
them). Nothing of the job was in the box before: the standby is Forgeline's own code, started
by the agent, and has run nothing of the user's.

It takes the capabilities to mount on the host and in the box's namespaces (the agent running
as root). Without them the helper fails, saying so, and the agent starts the job in a box of
its own as before (cold: seconds more of imports).

    python -m infra.late_mounts PID    # binds, one JSON object a line, on stdin
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import json
import os
import sys
from dataclasses import asdict

from infra.sandbox import Mount

# Linux's syscall numbers for the mount API: the same on every architecture (they came after
# the tables were unified, in 5.2 and 5.12).
SYS_OPEN_TREE, SYS_MOVE_MOUNT, SYS_MOUNT_SETATTR = 428, 429, 442
OPEN_TREE_CLONE, OPEN_TREE_CLOEXEC = 0x1, os.O_CLOEXEC
AT_FDCWD, AT_EMPTY_PATH, AT_RECURSIVE = -100, 0x1000, 0x8000
MOVE_MOUNT_F_EMPTY_PATH = 0x4
MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID, MOUNT_ATTR_NODEV = 0x1, 0x2, 0x4
CLONE_NEWNS = 0x20000
# A helper that has not finished by then is stuck: the job starts cold instead.
HELPER_TIMEOUT_S = 10.0


# The helper's exit status when it lacks the capabilities (EPERM, EACCES), not a passing fault.
NOT_PERMITTED = 77


class LateMountError(RuntimeError):
    """The binds could not be added; the message says which and why. `not_permitted`: this
    process may never add binds (it lacks the capabilities), so there is no point trying again."""

    def __init__(self, message: str, not_permitted: bool = False) -> None:
        super().__init__(message)
        self.not_permitted = not_permitted


class _MountAttr(ctypes.Structure):
    _fields_ = [
        ("attr_set", ctypes.c_uint64),
        ("attr_clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    ]


async def add_binds(pid: int, mounts: list[Mount]) -> None:
    """Add `mounts`, in order, to the box that process `pid` (on this host) runs in. Raises
    LateMountError with the helper's reason."""
    if not mounts:
        return
    helper = await asyncio.create_subprocess_exec(
        sys.executable, "-m", __name__, str(pid),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": _code_root()},
    )  # fmt: skip
    lines = "".join(json.dumps(asdict(mount)) + "\n" for mount in mounts).encode()
    try:
        _, said = await asyncio.wait_for(helper.communicate(lines), HELPER_TIMEOUT_S)
    except TimeoutError:
        helper.kill()
        await helper.wait()
        raise LateMountError(
            f"adding binds to the box of {pid} took over {HELPER_TIMEOUT_S} s"
        ) from None
    if helper.returncode != 0:
        reason = (said.decode(errors="replace").strip().splitlines() or ["no reason given"])[-1]
        raise LateMountError(
            f"binds not added to the box of {pid}: {reason}",
            not_permitted=helper.returncode == NOT_PERMITTED,
        )


def _code_root() -> str:
    """Where `infra` is imported from, for the helper (run from any folder)."""
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _Refused(OSError):
    """A syscall of the helper's failed (an OSError: its errno says whether it was denied)."""

    def __str__(self) -> str:
        return str(self.strerror)


def _check(result: int, what: str) -> int:
    if result < 0:
        code = ctypes.get_errno()
        raise _Refused(code, f"{what}: {os.strerror(code)} ({errno.errorcode.get(code, code)})")
    return result


def _detached_copy(libc: ctypes.CDLL, mount: Mount) -> int:
    """A detached copy of the mount of `mount.source` (and the mounts under it), read-only
    unless the bind is writable, with no device files unless it is one."""
    flags = OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC | AT_RECURSIVE
    fd = _check(
        libc.syscall(SYS_OPEN_TREE, AT_FDCWD, mount.source.encode(), flags),
        f"copying the mount of {mount.source}",
    )
    # A GPU's device file stays a device (bwrap's --dev-bind); nothing else may be one.
    attrs = MOUNT_ATTR_NOSUID | (0 if mount.device else MOUNT_ATTR_NODEV)
    attrs |= 0 if mount.writable else MOUNT_ATTR_RDONLY
    attr = _MountAttr(attrs, 0, 0, 0)
    _check(
        libc.syscall(SYS_MOUNT_SETATTR, fd, b"", AT_EMPTY_PATH | AT_RECURSIVE,
                     ctypes.byref(attr), ctypes.sizeof(attr)),
        f"making the copy of {mount.source} {'writable' if mount.writable else 'read-only'}",
    )  # fmt: skip
    return fd


def _attach(libc: ctypes.CDLL, fd: int, mount: Mount, folder: bool) -> None:
    """In the box's mount namespace: the mount point (a folder for a folder, else a file),
    then the copy on it."""
    if folder:
        os.makedirs(mount.path, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(mount.path), exist_ok=True)
        if not os.path.exists(mount.path):
            os.close(os.open(mount.path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600))
    _check(
        libc.syscall(SYS_MOVE_MOUNT, fd, b"", AT_FDCWD, mount.path.encode(),
                     MOVE_MOUNT_F_EMPTY_PATH),
        f"binding {mount.source} at {mount.path} in the box",
    )  # fmt: skip


def main() -> None:
    """The helper: copies every mount first (on the host, where the sources are), then enters
    the box and attaches them. A fresh process, so it has one thread, as setns needs."""
    pid = int(sys.argv[1])
    mounts = [Mount(**json.loads(line)) for line in sys.stdin if line.strip()]
    libc = ctypes.CDLL(None, use_errno=True)
    try:
        # What each source is, read here: in the box, the host's paths are not there.
        copies = [
            (_detached_copy(libc, mount), mount, os.path.isdir(mount.source)) for mount in mounts
        ]
        namespace = os.open(f"/proc/{pid}/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
        _check(libc.setns(namespace, CLONE_NEWNS), f"entering the mount namespace of {pid}")
        for fd, mount, folder in copies:
            _attach(libc, fd, mount, folder)
    except (_Refused, OSError) as err:
        print(err, file=sys.stderr)
        denied = getattr(err, "errno", None) in (errno.EPERM, errno.EACCES)
        raise SystemExit(NOT_PERMITTED if denied else 1) from None


if __name__ == "__main__":
    main()
