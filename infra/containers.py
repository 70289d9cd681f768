"""A run's ranks in a container image of its own (`train.image`), with podman.

A spec may name an image in place of a requirements file: the image brings the Python, the
torch and the libraries the script needs; the node brings Forgeline. Its packages are added to
the image's Python after the image's own (trainer/container_site/sitecustomize.py), so the
image's torch is the one the ranks run, and the image's Python must be the node's minor
version (Forgeline's compiled dependencies are built for it): `probe` checks that once per
image and node.

A container is the box of such a job (infra.sandbox's rules, with podman's namespaces in place
of bubblewrap's): its own pid, mount, ipc and uts namespaces; the image's root read-only with a
private /tmp; the job's paths bound as the rank box names them (trainer.rank_box); no
capability, no new privileges; the host's network for gloo and NCCL; the environment passed by
name (never on the command line, which every user of the host can read), with no credential
of the store in it. Nothing in it may outlive the agent: the agent holds a pipe whose other
end the container's first process reads (trainer/container_init.py); the agent's death closes
it, and that process then kills everything inside.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import shutil
import site
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

from infra.sandbox import Box

log = logging.getLogger(__name__)

PODMAN = "podman"
# The file descriptor inside the container that the agent's lifeline pipe is (podman passes
# 3 and up with --preserve-fds).
LIFELINE_FD = 3
# Every container of a job carries this label: an agent that restarts removes what a
# predecessor left (`remove_left_behind`).
NODE_LABEL = "forgeline.node"
# The image's own interpreter: what `python3` is on its PATH.
IMAGE_PYTHON = "python3"
# The host's settings that describe the node's Python, not the image's: never passed inside.
NODE_ONLY_VARIABLES = frozenset(
    {"PATH", "PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "LD_LIBRARY_PATH", "LD_PRELOAD"}
)
# Where Forgeline's packages are, for the container's sitecustomize (os.pathsep between).
NODE_PACKAGES_VARIABLE = "FORGELINE_NODE_PACKAGES"
SITE_FOLDER = Path(__file__).resolve().parents[1] / "trainer" / "container_site"
INIT_SCRIPT = Path(__file__).resolve().parents[1] / "trainer" / "container_init.py"
# Shared memory for the ranks of one node (torch's DataLoader workers, gloo): a tmpfs, taken
# only as it is used.
SHM_SIZE = "8g"
# podman 4.3 starts its runtime with at most this many processes whatever its own limit
# (measured: a higher --ulimit nproc is refused with EPERM where the host grants no
# CAP_SYS_RESOURCE), so a container's ranks are held to it.
PODMAN_MAX_NPROC = 32768
PROBE_TIMEOUT_S = 120.0
PULL_TIMEOUT_S = 1800.0


class ImageUnusable(Exception):
    """The run's image cannot run its ranks here; the message says why and what would fix it.
    The user's to fix (a wrong name, a Python the node's Forgeline cannot load into)."""


@dataclass(frozen=True)
class ContainerRuntime:
    """What runs containers on this node."""

    name: str
    version: str

    def describe(self) -> str:
        return f"{self.name} {self.version}"


def detect() -> ContainerRuntime | None:
    """podman, when it is installed and answers; None otherwise (the node then refuses runs
    that name an image, and says so: NodeInfo.container_runtime is empty)."""
    if shutil.which(PODMAN) is None:
        return None
    try:
        done = subprocess.run(
            [PODMAN, "version", "--format", "{{.Client.Version}}"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    version = done.stdout.strip()
    return ContainerRuntime(PODMAN, version) if done.returncode == 0 and version else None


@dataclass(frozen=True)
class ImageFacts:
    """What an image's Python is, as the node checked it."""

    image: str
    python: str  # "3.11.2"
    torch: str  # "2.13.0+cpu"


# What this agent found of each image it checked, by image id (a probe is a container start
# and a torch import: seconds).
_CHECKED: dict[str, ImageFacts] = {}


def node_python() -> str:
    return ".".join(str(part) for part in sys.version_info[:2])


def ensure_image(image: str) -> ImageFacts:
    """The image on this node (pulled if it is not there) and what its Python is; raise
    ImageUnusable with podman's own words if it cannot be had, or if its Python is not one the
    node's Forgeline can be loaded into."""
    if _podman("image", "exists", image, check=False).returncode != 0:
        pulled = _podman("pull", "--quiet", image, check=False, timeout=PULL_TIMEOUT_S)
        if pulled.returncode != 0:
            raise ImageUnusable(
                f"train.image {image!r} is not on this node and cannot be pulled: "
                f"{_last_line(pulled.stderr)} (push it to a registry the nodes reach, or load "
                "it on every node with `podman load`)"
            )
    # Checked once per image, by its id: a tag moved to another image is checked again.
    image_id = _podman("image", "inspect", "--format", "{{.Id}}", image).stdout.strip()
    if image_id not in _CHECKED:
        _CHECKED[image_id] = probe(image)
    return _CHECKED[image_id]


def probe(image: str) -> ImageFacts:
    """Run the image's python3 once: its version and its torch's."""
    said = _podman(
        "run", "--rm", "--network", "none", *ulimits(), "--entrypoint", IMAGE_PYTHON, image, "-c",
        "import json, sys; import torch; "
        "print(json.dumps([sys.version.split()[0], torch.__version__]))",
        check=False, timeout=PROBE_TIMEOUT_S,
    )  # fmt: skip
    if said.returncode != 0:
        raise ImageUnusable(
            f"train.image {image!r} cannot run the ranks: `{IMAGE_PYTHON} -c 'import torch'` "
            f"in it fails ({_last_line(said.stderr or said.stdout)}); the image needs "
            f"{IMAGE_PYTHON} {node_python()} with torch on its PATH"
        )
    python, torch = json.loads(said.stdout.strip().splitlines()[-1])
    if ".".join(python.split(".")[:2]) != node_python():
        raise ImageUnusable(
            f"train.image {image!r} runs Python {python}; this node's Forgeline is for Python "
            f"{node_python()}, and its packages are loaded into the image's interpreter: build "
            f"the image on Python {node_python()}"
        )
    return ImageFacts(image, python, torch)


@dataclass(frozen=True)
class ContainerBox:
    """The container a job's ranks run in: `image`, showing what `box` shows (the rank box's
    paths, at the same places inside)."""

    image: str
    box: Box
    node: str  # the node's id, on the container's label
    name: str = ""

    def named(self) -> ContainerBox:
        """This box with a name of its own (one container per start)."""
        return ContainerBox(self.image, self.box, self.node, f"forgeline-{uuid.uuid4().hex[:16]}")

    def argv(self, command: list[str], workdir: str, env_names: list[str]) -> list[str]:
        """podman's command line that runs `command` inside, in `workdir`, with the variables
        named in `env_names` taken from podman's own environment (the caller gives podman
        exactly what the container may hold)."""
        return [
            PODMAN, "run", "--rm", "--name", self.name or self.named().name,
            "--label", f"{NODE_LABEL}={self.node}",
            "--network", "host" if self.box.network else "none",
            "--ipc", "private", "--shm-size", SHM_SIZE,
            "--hostname", "forgeline-box",
            "--user", "0:0", "--cap-drop", "all", "--security-opt", "no-new-privileges",
            "--read-only", "--tmpfs", "/tmp:rw,exec",
            "--preserve-fds", "1", *ulimits(),
            *[flag for mount in self._mounts() for flag in mount],
            *[flag for name in env_names for flag in ("--env", name)],
            "--workdir", workdir,
            "--entrypoint", IMAGE_PYTHON,
            self.image,
            str(INIT_SCRIPT), str(LIFELINE_FD), "--", *command,
        ]  # fmt: skip

    def _mounts(self) -> list[tuple[str, str]]:
        mounts = []
        for mount in self.box.mounts():
            if mount.device:
                mounts.append(("--device", f"{mount.source}:{mount.path}"))
            else:
                mode = "rw" if mount.writable else "ro"
                mounts.append(("--volume", f"{mount.source}:{mount.path}:{mode}"))
        return mounts


def ulimits() -> list[str]:
    """The agent's own limits on open files and processes, for the container: what its ranks
    would have outside it, as in a box. podman's own defaults for root (a million files, four
    million processes) are refused on a host that grants no CAP_SYS_RESOURCE."""
    files = resource.getrlimit(resource.RLIMIT_NOFILE)
    procs = [
        PODMAN_MAX_NPROC if limit == resource.RLIM_INFINITY else min(limit, PODMAN_MAX_NPROC)
        for limit in resource.getrlimit(resource.RLIMIT_NPROC)
    ]
    return [
        "--ulimit", f"nofile={_limit(files[0])}:{_limit(files[1])}",
        "--ulimit", f"nproc={_limit(procs[0])}:{_limit(procs[1])}",
    ]  # fmt: skip


def _limit(value: int) -> str:
    return "-1" if value == resource.RLIM_INFINITY else str(value)


def container_environment(env: dict[str, str]) -> dict[str, str]:
    """A rank's environment inside an image: the node's Python settings dropped (the image has
    its own), and where Forgeline's packages are for the container's sitecustomize."""
    kept = {name: value for name, value in env.items() if name not in NODE_ONLY_VARIABLES}
    return {
        **kept,
        "PYTHONPATH": str(SITE_FOLDER),
        NODE_PACKAGES_VARIABLE: os.pathsep.join(node_site_folders()),
    }


def node_site_folders() -> list[str]:
    """The node's own site-packages (where Forgeline and its dependencies are installed), and
    the project's folder for an editable install, which its .pth files name."""
    return [path for path in site.getsitepackages() if Path(path).is_dir()]


def container_pid(name: str) -> int | None:
    """The host's pid of the container's first process (trainer/container_init.py); None while
    it is not running."""
    try:
        said = _podman("inspect", "--format", "{{.State.Pid}}", name, check=False, timeout=10)
        pid = int(said.stdout.strip())
    except (ValueError, OSError, subprocess.TimeoutExpired):
        return None  # not there (yet), or podman busy: asked again at the next look
    return pid if said.returncode == 0 and pid > 0 else None


def remove_left_behind(node_id: str) -> None:
    """Remove the containers a previous agent of this node left (it died before it could)."""
    if shutil.which(PODMAN) is None:
        return
    try:
        _podman("rm", "--force", "--filter", f"label={NODE_LABEL}={node_id}", check=False)
    except (OSError, subprocess.TimeoutExpired) as err:
        # A podman that does not answer is no reason for the agent not to start: what it left
        # has no lifeline and is ending anyway.
        log.warning("podman did not remove node %s's old containers: %s", node_id, err)


def _podman(
    *args: str, check: bool = True, timeout: float = 60.0
) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [PODMAN, *args], capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
    )
    if check and done.returncode != 0:
        raise RuntimeError(f"podman {' '.join(args[:2])}: {_last_line(done.stderr)}")
    return done


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:500] if lines else "no message"
