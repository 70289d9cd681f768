"""A box for code Forgeline did not write: bubblewrap (`bwrap`), without privileges.

Whatever a rank can reach, a user can reach. A box gives the processes inside:

- their own pid namespace: no other process on the host is visible, so no `/proc/<pid>/environ`
  of the agent (or of anyone) can be read;
- their own mount namespace on an empty root: the system's programs and libraries and the
  Python environment read-only, the paths the caller names read-only or writable, a private
  `/tmp`, and nothing else of the host (not the agent's state folder, env file or keys);
- their own user namespace, as a uid that is nobody's on the host, with no capabilities, so a
  read-only mount stays read-only;
- the host's network (gloo and NCCL need it), or none (`network=False`), and, where they exist,
  the GPU devices.

bwrap needs unprivileged user namespaces (or root). `check()` runs a box once and says why it
cannot where it cannot: the node agent refuses user code on such a host unless its operator
said, in so many words, that user code may run unconfined.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

BWRAP = "bwrap"
# The uid and gid inside: nobody's outside, so no file of the host is the box's by its owner.
BOX_UID = 61000
# From the host's /etc, what programs inside need to run and to resolve names; not its users,
# its keys or any service's configuration.
ETC_NEEDED = (
    "hosts", "resolv.conf", "nsswitch.conf", "host.conf", "gai.conf", "protocols", "services",
    "localtime", "ssl", "ca-certificates", "ca-certificates.conf", "ld.so.cache", "ld.so.conf",
    "ld.so.conf.d", "alternatives", "os-release", "mime.types",
)  # fmt: skip
# The system's own top-level folders: real folders are bound read-only, the merged-/usr
# links (`/bin -> usr/bin`) are made again as links.
SYSTEM_ROOTS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
# NVIDIA's device files; AMD's are /dev/kfd and /dev/dri. Where a host's device files are
# (a test puts stand-ins elsewhere); a box shows them at /dev.
DEVICE_ROOT = "/dev"
GPU_DEVICE_GLOBS = ("nvidia*", "nvidia-caps/*", "kfd", "dri/*")
# One NVIDIA GPU's own file, /dev/nvidia<minor>; the others (nvidiactl, nvidia-uvm, …) every
# process that uses any GPU needs.
NVIDIA_GPU_FILE = re.compile(r"nvidia(\d+)")


class SandboxUnavailable(RuntimeError):
    """This host cannot make a box; the message says why and what would fix it."""


@dataclass(frozen=True)
class Mount:
    """One bind of a box: the host's `source` at `path` inside, read-only unless `writable`."""

    source: str
    path: str
    writable: bool
    device: bool = False  # a device file: usable as one (no `nodev`)

    def flags(self) -> list[str]:
        if self.device:
            return ["--dev-bind", self.source, self.path]
        return ["--bind" if self.writable else "--ro-bind", self.source, self.path]


@dataclass(frozen=True)
class Box:
    """What one box shows: paths as they are named on the host, at the same place inside. Two
    boxes that show the same are equal: a process started in one can do the work of the other."""

    read_only: tuple[str, ...] = ()
    writable: tuple[str, ...] = ()
    # Writable, at another path inside: (on the host, in the box).
    mapped: tuple[tuple[str, str], ...] = ()
    # False: a network namespace of its own, loopback only (code that needs no network, such as
    # a model answering prompts over a pipe or a unix socket, reaches nothing through it).
    network: bool = True
    # The NVIDIA GPUs it shows, by their device file's number (/dev/nvidia<N>): a job packed
    # on a node beside another is shown its own GPUs alone (infra.gpu_devices). None: every
    # GPU device of the host (AMD's are always all: their files do not map to one GPU each).
    gpus: tuple[int, ...] | None = None

    def argv(self, command: list[str], workdir: str = "/") -> list[str]:
        """bwrap's command line that runs `command` in this box, in `workdir`. The command
        inside gets bwrap's own environment: the caller gives bwrap exactly what the box may
        hold (never on this command line, which every user of the host can read)."""
        return [
            _bwrap(),
            *_namespaces(),
            *([] if self.network else ["--unshare-net"]),
            *_fresh_mounts(),
            *_system_mounts(),
            *[flag for mount in self.mounts() for flag in mount.flags()],
            "--chdir", workdir,
            "--",
            *command,
        ]  # fmt: skip

    def mounts(self) -> list[Mount]:
        """The box's own binds, in the order they are made: its paths, the mapped ones, then
        the GPUs' device files."""
        mapped = [Mount(host, inside, writable=True) for host, inside in self.mapped]
        return [*_binds(self.read_only, self.writable), *mapped, *_gpu_devices(self.gpus)]

    def beyond(self, base: Box) -> list[Mount] | None:
        """The binds that, added to a box made as `base`, make it show what this box shows, in
        the order to add them (infra.late_mounts: a standby made before its job was known);
        None when no binds can: another network, a bind of `base`'s this box lacks, or one of
        this box's that would cover one of `base`'s."""
        own, theirs = self.mounts(), base.mounts()
        if self.network != base.network or any(mount not in own for mount in theirs):
            return None
        added = [mount for mount in own if mount not in theirs]
        if any(_inside(old.path, new.path) for new in added for old in theirs):
            return None
        return added


def python_paths() -> tuple[str, ...]:
    """The interpreter and its installation (the venv, the base installation it was made
    from): read-only in a box. Not the rest of `sys.path`: its first entry may be the current
    folder, which can hold a state folder. An editable project's source folders are the
    caller's to add."""
    found = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    return _outermost(p for p in found if not _is_system(p))


def check(timeout_s: float = 10.0) -> None:
    """Make one box and run `true` in it; raise SandboxUnavailable with the reason if it fails."""
    if shutil.which(BWRAP) is None:
        raise SandboxUnavailable(
            "bwrap is not installed (Debian and Ubuntu: apt-get install bubblewrap)"
        )
    argv = Box(read_only=python_paths()).argv(["true"])
    try:
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=timeout_s, env={"PATH": "/usr/bin:/bin"}
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        raise SandboxUnavailable(f"bwrap did not run: {err}") from None
    if done.returncode != 0:
        said = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        raise SandboxUnavailable(
            f"bwrap cannot make a box here ({said}): user namespaces may be off "
            "(sysctl kernel.unprivileged_userns_clone=1, or a container's seccomp profile "
            "that allows them)"
        )


def _bwrap() -> str:
    found = shutil.which(BWRAP)
    if found is None:
        raise SandboxUnavailable("bwrap is not installed (apt-get install bubblewrap)")
    return found


def _namespaces() -> list[str]:
    return [
        "--unshare-user", "--uid", str(BOX_UID), "--gid", str(BOX_UID),
        "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
        "--hostname", "forgeline-box",
        # Everything inside dies with the process that made the box (the agent's torchrun
        # watch): a dead agent is a failed node, and nothing of its ranks may outlive it.
        "--die-with-parent",
        # No controlling terminal: a process inside cannot push keystrokes into the agent's.
        "--new-session",
    ]  # fmt: skip


def _fresh_mounts() -> list[str]:
    """The box's own /proc (its processes only), /dev (null, zero, random, tty, no disks),
    /tmp and /dev/shm (torch's shared memory between a node's ranks)."""
    return ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--tmpfs", "/dev/shm"]


def _binds(read_only: Iterable[str], writable: Iterable[str]) -> list[Mount]:
    """Every bind in order of depth, so a path inside another is mounted over it (a read-only
    checkpoint inside a writable folder stays read-only). A path inside another of the same
    kind is that one's already, and gets no mount of its own: a file is renamed only within
    one mount, so a folder and a folder inside it must stay one."""
    wanted = [(os.path.abspath(p), False) for p in read_only] + [
        (os.path.abspath(p), True) for p in writable
    ]
    mounts: list[Mount] = []
    for path, writable_ in sorted(set(wanted), key=lambda item: (_depth(item[0]), item)):
        source = os.path.realpath(path)
        if not os.path.exists(source):
            continue  # a job's optional path not made yet (a fallback's folder)
        holder = next((m.writable for m in reversed(mounts) if _inside(path, m.path)), None)
        if holder == writable_:
            continue
        mounts.append(Mount(source, path, writable_))
    return mounts


def _inside(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def _system_mounts() -> list[str]:
    mounts: list[str] = []
    for root in SYSTEM_ROOTS:
        if os.path.islink(root):
            mounts += ["--symlink", os.readlink(root), root]
        elif os.path.isdir(root):
            mounts += ["--ro-bind", root, root]
    for name in ETC_NEEDED:
        path = f"/etc/{name}"
        if os.path.exists(path):
            mounts += ["--ro-bind", path, path]
    return mounts


def _gpu_devices(gpus: tuple[int, ...] | None) -> list[Mount]:
    """The host's GPU device files the box shows at /dev: every one, or with `gpus`, every one
    but the NVIDIA GPUs not in it."""
    root = Path(DEVICE_ROOT)
    devices: list[Mount] = []
    for pattern in GPU_DEVICE_GLOBS:
        for path in sorted(root.glob(pattern)):
            own = NVIDIA_GPU_FILE.fullmatch(path.name)
            if gpus is not None and own is not None and int(own.group(1)) not in gpus:
                continue
            inside = "/dev/" + str(path.relative_to(root))
            devices.append(Mount(str(path), inside, writable=True, device=True))
    return devices


def _depth(path: str) -> int:
    return len(Path(os.path.abspath(path)).parts)


def _is_system(path: str) -> bool:
    return any(path == root or path.startswith(root + "/") for root in SYSTEM_ROOTS)


def _outermost(paths: Iterable[str]) -> tuple[str, ...]:
    """The paths none of the others holds (binding a folder binds what is inside it)."""
    kept: list[str] = []
    for path in sorted({os.path.abspath(p) for p in paths}, key=len):
        if not any(_inside(path, k) for k in kept):
            kept.append(path)
    return tuple(sorted(kept))
