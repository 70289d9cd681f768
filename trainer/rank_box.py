"""The box a node's ranks run in (infra.sandbox), and whether this node may make one.

What a job's box shows, at the paths the job file names:

- read-only: the Python environment and Forgeline's packages, and the environment built for
  the run's requirements (infra.user_envs) when it has one; the job's token shards; the
  run's code as materialized for this run (infra.code_snapshot.materialize); the base model a
  fine-tune starts from; this node's cached copies of the run's own checkpoints;
- writable: the run's folder on this node (job file, progress, logs, staging, the peer-tier
  files it gathers, the node's copies of its checkpoints), and, while ranks still write
  checkpoints to the store themselves, a store that is a folder;
- nothing else: not the agent's state folder, its env file or keys, the node cache's other
  entries (other runs' data and weights), or any other process.

A node's warm standby (trainer.warm_launch) waits in `standby_box()`, the part every job's box
shares; the job it becomes gets the rest of its box added before it is handed over
(infra.late_mounts), so it runs in what `rank_box` describes, whichever run it is.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from infra import sandbox
from infra.sandbox import Box, SandboxUnavailable
from trainer.job import TrainJob

log = logging.getLogger(__name__)

# Forgeline's own packages, wherever they are installed (an editable install keeps them in the
# project's folder, beside things that are not code: the local stack's state folder).
PACKAGES = ("activities", "dataprep", "forgeline", "infra", "registry", "trainer", "worker",
            "workflows")  # fmt: skip
PACKAGE_ROOT = Path(__file__).resolve().parents[1]
# The one value --unconfined-user-code takes: the operator says, in so many words, what it means.
UNCONFINED_FORM = "user-code-sees-what-this-agent-sees"
# What a rank's environment says about itself in place of the agent's home and user.
BOX_HOME = "/tmp"
# Where a box finds its run's store door, whatever the host's path.
BOX_DOOR = "/run/forgeline"
DOOR_SOCKET = "door.sock"
# The agent's own store settings: a boxed rank reaches the store through its door only.
STORE_SETTINGS = frozenset({"FORGELINE_STORE", "FORGELINE_TWIN_STORE"})
BOX_USER = "forgeline-rank"


class Confinement(StrEnum):
    BOX = "box"  # every rank in a box
    UNCONFINED = "unconfined"  # the operator allowed user code to run as the agent runs
    REFUSED = "refuses user code"  # cannot box, not allowed unconfined: built-in trainer only


@dataclass(frozen=True)
class NodeConfinement:
    mode: Confinement
    why: str = ""  # why not a box (empty for a box)

    def describe(self) -> str:
        return self.mode.value + (f": {self.why}" if self.why else "")


class UnconfinedFormError(ValueError):
    """--unconfined-user-code was given without its one explicit value."""


def check_unconfined_form(unconfined: str | None) -> None:
    """Refuse --unconfined-user-code with anything but its one explicit value."""
    if unconfined is not None and unconfined != UNCONFINED_FORM:
        raise UnconfinedFormError(
            f"--unconfined-user-code {unconfined!r}: the only accepted value is "
            f"{UNCONFINED_FORM!r}, which says that users' scripts will read what this agent "
            "reads (its credentials included); leave the option out to box them"
        )


def decide(unconfined: str | None) -> NodeConfinement:
    """Box the ranks where this host can; run them unconfined only where the operator said so
    with the explicit form; otherwise refuse user code, saying why."""
    check_unconfined_form(unconfined)
    if unconfined is not None:
        return NodeConfinement(
            Confinement.UNCONFINED, "started with --unconfined-user-code by its operator"
        )
    try:
        sandbox.check()
    except SandboxUnavailable as err:
        return NodeConfinement(Confinement.REFUSED, str(err))
    return NodeConfinement(Confinement.BOX)


def standby_box() -> Box:
    """What every job's box shows, and nothing of any run: the Python environment and
    Forgeline's packages, and the GPU files every job needs but no GPU's own. A node's warm
    standby waits in one; the job it becomes gets its own binds (its GPUs' among them) added
    there (trainer.warm_launch)."""
    return Box(read_only=_platform_paths(), gpus=())


def _platform_paths() -> tuple[str, ...]:
    return (*sandbox.python_paths(), *(str(PACKAGE_ROOT / name) for name in PACKAGES))


def rank_box(
    job: TrainJob,
    run_dir: Path,
    own_checkpoints: Path,
    door: Path | None,
    gpus: tuple[int, ...] | None = None,
    python_env: Path | None = None,
) -> Box:
    """The box of `job`'s ranks: `run_dir` is the run's folder on this node (every generation's
    folder is inside it), `own_checkpoints` the node cache's folder of the run's checkpoints,
    `door` the folder of the run's store door (trainer.store_door), at BOX_DOOR inside; `gpus`
    the device files of the GPUs the job holds (infra.gpu_devices; None: every GPU's);
    `python_env` the folder of the environment its ranks run in (shared by every run that
    declares the same requirements: read-only)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    own_checkpoints.mkdir(parents=True, exist_ok=True)
    read_only = [
        *_platform_paths(),
        *job.train_shards,
        *job.val_shards,
        job.code_dir,
        job.init_weights,
        str(own_checkpoints),
        str(python_env) if python_env else "",
    ]
    # The node's copies of the run's checkpoints are in the run's folder (activities.node): the
    # ranks move their files there from staging by a rename, which fails between two mounts.
    writable = [str(run_dir), job.local_copies, job.peer_copies]
    if door is None:
        # Ranks that write to the store themselves (a test's): a store that is a folder must
        # be in the box.
        writable += [_folder_of(url) for url in (job.store_url, job.twin_store_url)]
    return Box(
        read_only=tuple(p for p in read_only if p),
        writable=tuple(p for p in writable if p),
        mapped=((str(door), BOX_DOOR),) if door is not None else (),
        gpus=gpus,
    )


def door_url() -> str:
    """The store URL of a boxed job: its agent's door (infra.store.door), as the box shows it."""
    return f"door://{BOX_DOOR}/{DOOR_SOCKET}"


def box_environment(env: dict[str, str]) -> dict[str, str]:
    """A rank's environment inside the box: no credential of the store (it goes through its
    agent's door), home and temporary files in the box's own /tmp, a user name that is
    nobody's (libraries that ask getpass for one get it)."""
    kept = {name: value for name, value in env.items() if not _store_credential(name)}
    return {**kept, "HOME": BOX_HOME, "TMPDIR": BOX_HOME, "USER": BOX_USER, "LOGNAME": BOX_USER}


def _store_credential(name: str) -> bool:
    """The store's access and where to find it: S3's keys, profiles, credential files."""
    return name.startswith(("AWS_", "BOTO_")) or name in STORE_SETTINGS


def _folder_of(store_url: str) -> str:
    """The folder a store URL names (a path or file://PATH); "" for any other store."""
    if store_url.startswith("file://"):
        return store_url.removeprefix("file://")
    return "" if "://" in store_url else store_url
