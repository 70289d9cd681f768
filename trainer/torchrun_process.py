"""A node's torchrun as the agent sees it: its ranks, its stacks, and how it is stopped.

torchrun is the agent's child, or, when the ranks run in a box (trainer.rank_box), the
grandchild of bwrap: bwrap → the box's init → torchrun → ranks. Signals meant for torchrun go
to torchrun itself (bwrap passes none on); killing bwrap ends the whole box, since everything
in it dies with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Callable
from pathlib import Path

# What every rank runs; a rank names itself with this path (trainer.entry.as_a_fresh_rank),
# which is how ranks are told from a process that reused a pid.
RANK_SCRIPT = str(Path(__file__).resolve().with_name("entry.py"))
# How long a boxed torchrun may take to appear under bwrap (a few milliseconds, measured).
_BOX_START_S = 2.0
# A container takes longer: podman sets up its mounts and namespaces (about a second here).
_CONTAINER_START_S = 30.0


def children(pid: int) -> list[int]:
    """A process's children, from every one of its threads."""
    pids = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            pids += [int(p) for p in (task / "children").read_text().split()]
    return pids


def in_box(bwrap_pid: int) -> int | None:
    """The process bwrap runs in its box, on the host (bwrap → the box's init → it); None
    while it is not there yet."""
    inside = [pid for init in children(bwrap_pid) for pid in children(init)]
    return inside[0] if inside else None


async def started_in_box(
    bwrap: asyncio.subprocess.Process, find: Callable[[], int | None] | None = None
) -> int | None:
    """`in_box` (or `find`), once bwrap (or podman) has made the box and started it (a few
    milliseconds, seconds on a busy machine); None if bwrap exits first or it takes longer
    than _BOX_START_S."""
    within_s = _BOX_START_S if find is None else _CONTAINER_START_S
    find = find or (lambda: in_box(bwrap.pid))
    deadline = asyncio.get_running_loop().time() + within_s
    while (pid := find()) is None and bwrap.returncode is None:
        if asyncio.get_running_loop().time() > deadline:
            break
        await asyncio.sleep(0.01 if within_s == _BOX_START_S else 0.2)
    return pid


def rank_pids(launcher_pid: int) -> list[int]:
    """The rank processes torchrun started (its children)."""
    return children(launcher_pid)


def runs_trainer(pid: int) -> bool:
    try:
        return RANK_SCRIPT.encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def dump_rank_stacks(launcher_pid: int) -> None:
    """Ask every rank to print its threads' stacks into its stacks file (SIGUSR1, see
    trainer.entry): what was each rank doing when it was given up on."""
    for pid in rank_pids(launcher_pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGUSR1)


class TorchrunProcess:
    """The process the agent started for one job (torchrun, or bwrap around it, or podman
    running a container with it inside: trainer.container_launch)."""

    def __init__(
        self,
        proc: asyncio.subprocess.Process,
        boxed: bool,
        find_inside: Callable[[], int | None] | None = None,
        lifeline: int | None = None,
    ) -> None:
        self.proc = proc
        self.boxed = boxed or find_inside is not None
        self._torchrun: int | None = None if self.boxed else proc.pid
        # How a container's torchrun is found (through podman); a box's is bwrap's grandchild.
        self._find_in_container = find_inside
        # A container's: the pipe whose closing ends it (trainer/container_init.py).
        self._lifeline = lifeline

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    async def wait(self) -> int:
        return await self.proc.wait()

    def release(self) -> None:
        """Let go of a container's lifeline: whatever still runs inside it ends."""
        if self._lifeline is not None:
            with contextlib.suppress(OSError):
                os.close(self._lifeline)
            self._lifeline = None

    def torchrun_pid(self) -> int | None:
        """torchrun's pid on the host (None: a box whose torchrun is not there yet or is gone)."""
        if self._torchrun is None:
            find = self._find_in_container
            self._torchrun = find() if find is not None else in_box(self.proc.pid)
        return self._torchrun

    async def _found_torchrun(self) -> int | None:
        if self._torchrun is None and self.boxed:
            self._torchrun = await started_in_box(self.proc, self._find_in_container)
        return self._torchrun

    def ranks(self) -> list[int]:
        pid = self.torchrun_pid()
        return rank_pids(pid) if pid is not None else []

    def ranks_alive(self) -> bool:
        """Whether any of torchrun's ranks still runs (an exited one is a zombie until torchrun
        reaps it, with an empty command line)."""
        return any(runs_trainer(pid) for pid in self.ranks())

    async def stop(self, grace_s: float = 10.0, dump_stacks: bool = True) -> bool:
        """Record the ranks' stacks, SIGTERM torchrun (it passes it on: the ranks try to
        checkpoint), then SIGKILL torchrun and its ranks if they linger (a stopped or wedged
        rank would not notice it was orphaned). True if they ended within the grace."""
        if self.returncode is not None:
            return True
        torchrun = await self._found_torchrun()
        ranks = self.ranks()
        if dump_stacks and torchrun is not None:
            dump_rank_stacks(torchrun)
            await asyncio.sleep(0.5)
        with contextlib.suppress(ProcessLookupError):
            if torchrun is None:  # a box that never started its torchrun: nothing to save
                self.proc.kill()
                self.release()
            else:
                os.kill(torchrun, signal.SIGTERM)
        try:
            await asyncio.wait_for(self.proc.wait(), timeout=grace_s)
        except TimeoutError:
            await self.kill(ranks)
            return False
        return True

    async def ask_ranks_to_stop(self, grace_s: float) -> bool:
        """SIGTERM the ranks themselves, not torchrun, and give them `grace_s` to save and
        return (a script that keeps its own checkpoints). torchrun then ends as it does when
        its ranks finish: it reads each rank's result, which a rank that returned waits for.
        A torchrun that was SIGTERMed itself never reads them, so a rank that saved and
        returned would wait out torchrun's own 30 s before being killed. Past the grace, or
        with no rank to ask: `stop`. True if they ended within the grace."""
        if self.returncode is not None:
            return True
        ranks = [pid for pid in self.ranks() if runs_trainer(pid)]
        if not ranks:
            return await self.stop(grace_s=grace_s, dump_stacks=False)
        for pid in ranks:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(self.proc.wait(), timeout=grace_s)
        except TimeoutError:
            await self.stop(grace_s=2.0, dump_stacks=False)
            return False
        return True

    async def kill(self, ranks: list[int] | None = None) -> None:
        """SIGKILL torchrun (or its box) and its ranks; `ranks` as they were before torchrun
        was asked to stop."""
        ranks = self.ranks() if ranks is None else ranks
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        self.release()  # a container's processes are not podman's children: end them too
        for pid in ranks:
            if runs_trainer(pid):  # still the rank, not a process that reused its pid
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        await self.proc.wait()
