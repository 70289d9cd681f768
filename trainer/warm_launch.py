"""torchrun started ahead of its job, so a node's next generation skips the imports.

Importing torch takes about 3 s of a restart (2.8 s on the 2-core CI machine). torchrun forks
its ranks from itself (trainer.launch), so they share its imports; a restart would still pay
them once, in a fresh torchrun. A node agent therefore keeps one standby: a Python process that
has already imported `torch.distributed.run`, the rank entry and the built-in trainer with the
SDK, and waits on its stdin for one job (torchrun's arguments, the environment, the folder and
the log file). Given one, it becomes that job's torchrun; the process tree is the one a cold
start makes (agent → torchrun → ranks), so stopping, stack dumps and parent-death work as
before. The agent makes the next standby once the ranks it launched are training, so the
imports never compete with a restart for the CPU.

A standby runs the code it imported. Should Forgeline's files change under a running agent (an
upgrade in place), a standby made before would start the job on the old code, mixed with the new
files its ranks import later (on the local stack: an AttributeError from the old
`trainer.checkpoint`). So the launcher notes the code's files (path, size, mtime) when it makes a
standby, and a standby whose files have changed since is discarded for a cold start.

    python -m trainer.warm_launch     # the standby; the agent writes one JSON line to its stdin
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import logging
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import setproctitle

from infra.late_mounts import LateMountError, add_binds
from infra.parent_death import die_with_parent
from infra.sandbox import Box
from trainer.rank_box import box_environment
from trainer.rank_env import rank_environment
from trainer.torchrun_process import started_in_box

log = logging.getLogger(__name__)

STANDBY_MODULE = "trainer.warm_launch"
RANK_IMPORTS = ("trainer.entry", "trainer.train")  # the rank entry, the built-in trainer, the SDK
# Where the code a standby imports lives: the packages the rank entry and the SDK import.
CODE_ROOTS = tuple(
    Path(__file__).resolve().parents[1] / package
    for package in ("trainer", "forgeline", "infra", "workflows")
)


def code_fingerprint(roots: tuple[Path, ...]) -> tuple[tuple[str, int, int], ...]:
    """Every Python file under `roots` with its size and modification time: a few hundred
    stat calls, about a millisecond, once per standby made and once per standby used."""
    files = []
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            stat = path.stat()
            files.append((str(path), stat.st_size, stat.st_mtime_ns))
    return tuple(files)


@dataclass(frozen=True)
class LaunchOrder:
    """What the standby needs to become a job's torchrun: what a cold start gives its process."""

    args: list[str]  # torchrun's arguments, after `python -m torch.distributed.run`
    env: dict[str, str]
    cwd: str
    log_file: str  # stdout and stderr of torchrun and its ranks (appended)

    def line(self) -> bytes:
        return (json.dumps(asdict(self)) + "\n").encode()


class WarmLauncher:
    """The node agent's standby torchrun: at most one, made by `prepare`, used by `start`."""

    def __init__(self, cwd: Path, code_roots: tuple[Path, ...] = CODE_ROOTS) -> None:
        self._cwd = cwd
        self._code_roots = code_roots
        self._code_seen: tuple[tuple[str, int, int], ...] = ()  # when the standby was made
        self._standby: asyncio.subprocess.Process | None = None
        # The box the standby lives in (None: none): a job needing another box starts cold.
        self._box: Box | None = None
        # Jobs sharing a node each make one when their ranks train: only the first may.
        self._making = asyncio.Lock()
        # False once adding a job's binds to a standby's box failed (infra.late_mounts).
        self._binds_can_be_added = True

    @property
    def ready(self) -> bool:
        return self._standby is not None and self._standby.returncode is None

    @property
    def pid(self) -> int | None:
        """The waiting standby's process id (None: none waits)."""
        return self._standby.pid if self._standby is not None and self.ready else None

    async def prepare(self, box: Box | None = None) -> None:
        """Start a standby unless one waits already (it imports torch in the background), in
        `box` when the next job's ranks run in one: trainer.rank_box.standby_box(), which shows
        nothing of any run; `start` adds the job's own binds."""
        if box is not None and not self._binds_can_be_added:
            return  # it could never become a boxed job's torchrun here
        async with self._making:
            if self.ready and self._box != box:  # a standby for another run's box
                await self.close()
            if not self.ready:
                self._code_seen = code_fingerprint(self._code_roots)
                self._standby = await self._spawn(box)
                self._box = box

    async def _spawn(self, box: Box | None) -> asyncio.subprocess.Process:
        self._cwd.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", STANDBY_MODULE]
        # Never the agent's secrets, even before a job replaces the environment.
        env = {**rank_environment(os.environ), "PYTHONUNBUFFERED": "1"}
        if box is not None:
            env = box_environment(env)
        return await asyncio.create_subprocess_exec(
            *(box.argv(command, "/") if box is not None else command),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
            env=env,
            cwd=self._cwd,
            # As a cold torchrun: it dies with the agent, and its ranks with it.
            preexec_fn=die_with_parent,
        )  # fmt: skip

    async def start(
        self, order: LaunchOrder, box: Box | None = None
    ) -> asyncio.subprocess.Process | None:
        """Hand `order` to the standby and return it as the job's torchrun (or the bwrap around
        it), once its box shows what `box` shows; None when there is no live standby that can
        run in the box the job needs (the caller starts torchrun cold)."""
        standby, self._standby = self._standby, None
        if standby is None:
            return None
        current = code_fingerprint(self._code_roots) == self._code_seen
        stdin = standby.stdin
        alive = standby.returncode is None
        if current and alive and stdin is not None and await self._fitted(standby, box):
            try:
                stdin.write(order.line())
                await stdin.drain()
                stdin.close()
                log.info(
                    "the job in %s starts on the warm standby (pid %d)", order.cwd, standby.pid
                )
                return standby
            except (BrokenPipeError, ConnectionResetError):  # it died since it was made
                pass
        await _discard(standby)
        return None

    async def _fitted(self, standby: asyncio.subprocess.Process, box: Box | None) -> bool:
        """Whether the standby runs in `box` now: it was made in it, or in a box that the job's
        own binds make into it, and they were added (infra.late_mounts)."""
        if box is None or self._box is None:
            return box == self._box
        added = box.beyond(self._box)
        if added is None:
            log.warning("the warm standby was not used: its box cannot become the job's")
            return False
        # A standby made a moment ago may not be in its box yet (bwrap makes it first).
        if (inside := await started_in_box(standby)) is None:
            log.warning("the warm standby was not used: it did not start in its box")
            return False
        try:
            await add_binds(inside, added)
        except LateMountError as err:
            # Without the capabilities to mount, no boxed standby can ever be used here.
            self._binds_can_be_added = not err.not_permitted
            later = (
                "" if self._binds_can_be_added else ", and boxed jobs here start cold from now on"
            )
            log.warning("the warm standby was not used%s: %s", later, err)
            return False
        return True

    async def close(self) -> None:
        """Stop an unused standby (it would die with the agent anyway)."""
        standby, self._standby = self._standby, None
        if standby is not None:
            await _discard(standby)


async def _discard(standby: asyncio.subprocess.Process) -> None:
    with contextlib.suppress(ProcessLookupError):
        standby.kill()
    await standby.wait()


def _become(order: LaunchOrder) -> None:
    """Take on the job's folder, environment and output, as a cold start's process has them."""
    os.chdir(order.cwd)
    os.environ.clear()
    os.environ.update(order.env)
    log = os.open(order.log_file, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    for fd in (1, 2):
        os.dup2(log, fd)
    os.close(log)
    nothing = os.open(os.devnull, os.O_RDONLY)
    os.dup2(nothing, 0)  # the ranks inherit an empty stdin, not the agent's pipe
    os.close(nothing)


def main() -> None:
    # What this process is for: the imports. torchrun's (~3 s of torch), and the ranks': they
    # are forked from it (trainer.launch), so the rank entry and the built-in trainer with the
    # SDK (boto3, tokenizers, safetensors) are imported here, once, not by every rank. Imports
    # only: a thread started here would not be in the forked ranks.
    # Named before _become replaces the environment: setproctitle finds the room for a name
    # (the arguments' and the environment's memory) only while the environment is the original.
    setproctitle.setproctitle(f"{sys.executable} -m {STANDBY_MODULE} (a standby torchrun)")
    from torch.distributed import run as torchrun

    for module in RANK_IMPORTS:
        importlib.import_module(module)

    line = sys.stdin.buffer.readline()
    if not line:  # the agent closed the pipe without a job: it is shutting down
        return
    order = LaunchOrder(**json.loads(line))
    _become(order)
    sys.argv = ["torchrun", *order.args]
    # The command line of a cold torchrun, so that it is found (and its ranks) as one is.
    setproctitle.setproctitle(
        " ".join([sys.executable, "-m", "torch.distributed.run", *order.args])
    )
    torchrun.main(order.args)


if __name__ == "__main__":
    main()
