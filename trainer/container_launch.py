"""torchrun started inside a job's container (infra.containers), and found there.

The container's processes are not the agent's descendants (podman's conmon is their parent),
so what the agent knows of them comes from podman (the container's first process, by its name)
and from /proc on the host, where every process inside is visible with its host pid.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable

from infra.containers import LIFELINE_FD, ContainerBox, container_pid
from infra.parent_death import die_with_parent
from trainer.torchrun_process import children


async def start_in_container(
    command: list[str], box: ContainerBox, env: dict[str, str], cwd: str, log_file: str
) -> tuple[asyncio.subprocess.Process, int]:
    """podman running `command` in `box`, and the write end of its lifeline (close it and the
    container ends: trainer/container_init.py)."""
    read_end, write_end = os.pipe()
    argv = box.argv(command, cwd, sorted(env))
    try:
        with open(log_file, "ab") as log:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log,
                stderr=asyncio.subprocess.STDOUT,
                env={**env, "PATH": os.environ.get("PATH", "/usr/bin:/bin")},
                cwd=cwd,
                pass_fds=(LIFELINE_FD,),
                preexec_fn=_lifeline_at(read_end),
            )
    finally:
        os.close(read_end)  # podman holds it now; the agent keeps only the write end
    return proc, write_end


def _lifeline_at(read_end: int) -> Callable[[], None]:
    """In podman's process before it runs: the pipe's read end at the descriptor podman passes
    on (--preserve-fds 1 is descriptor 3), and podman dies with the agent."""

    def prepare() -> None:
        os.dup2(read_end, LIFELINE_FD)
        die_with_parent()

    return prepare


def torchrun_in(container: str) -> int | None:
    """torchrun's pid on the host: the child of the container's first process; None while it
    is not there (yet, or any more)."""
    init = container_pid(container)
    if init is None:
        return None
    inside = children(init)
    return inside[0] if inside else None
