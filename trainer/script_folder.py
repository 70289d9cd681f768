"""The node agent's half of a script that keeps its own checkpoints (level 1: it never imports
Forgeline): commit its checkpoint folder while the ranks run, and once more at their end.

The ranks write wherever the script saves (`FORGELINE_CHECKPOINT_DIR`, or the argument the spec
puts it in); trainer.folder_watch decides when the folder is quiet enough to commit. Each commit
becomes progress lines in the ranks' progress file, written here for them (a step and its
checkpoint: the script says nothing), so heartbeats, the cluster's view of what a preemption
would lose, and the run's final step read as they do for the SDK's runs.

The end decides what is committed last:
- the ranks all exited 0: the folder is committed once more (no settle period), and the job is
  done;
- they exited on a SIGTERM they were given (a preemption, a drain) within its grace: the same,
  and the job stopped;
- they crashed or had to be killed: nothing more. A file a dead process was writing cannot be
  told from a finished one, so only what was committed while the ranks lived counts; the next
  gang resumes from it.

Only the agent of the gang's first node commits (the node of global rank 0, which is where a
script's `if rank == 0: torch.save(...)` writes); every node restores the folder before its
ranks start (activities.node), since every rank may read it to resume.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from pathlib import Path

from trainer.folder_watch import FolderPoll, FolderState, FolderWatcher
from trainer.job import TrainJob
from trainer.step_share import ASKED_TO_STOP, STOP_REASONS

log = logging.getLogger(__name__)

POLL_S = 1.0
FINAL_COMMIT_S = 60.0  # how long the last commit waits for a process still writing
# Asked to stop (a preemption, a drain), the ranks get a SIGTERM and this long to save and
# return: within the cluster's preemption grace (120 s by default), with time for the commit.
SCRIPT_STOP_GRACE_S = 45.0


def script_folder_environment(job: TrainJob) -> dict[str, str]:
    """What a script that keeps its own checkpoints is told: where its folder is, and whether
    it holds the run's last commit to resume from ("1") or is empty ("0")."""
    if not job.checkpoint_folder:
        return {}
    return {
        "FORGELINE_CHECKPOINT_DIR": job.checkpoint_folder,
        "FORGELINE_RESUMED": "1" if job.checkpoint_resumed else "0",
    }


class ScriptFolder:
    """One generation's checkpoint folder on this node, as its ranks run."""

    def __init__(
        self, folder: Path, progress_file: Path, watcher: FolderWatcher | None, stop_file: Path
    ) -> None:
        self.folder = folder
        self.watcher = watcher  # None: another node of the gang commits
        self.stop_file = stop_file
        self.progress_file = progress_file
        self.committed = watcher.last_step if watcher is not None else 0
        self._stopping = asyncio.Event()
        self._task: asyncio.Task | None = None

    @property
    def asked_to_stop(self) -> bool:
        """The agent was asked to checkpoint and stop (activities.node.stop_training)."""
        return self.stop_file.exists()

    @property
    def fenced(self) -> bool:
        return self.watcher is not None and self.watcher.fenced

    def start(self, every_s: float = POLL_S) -> None:
        """Commit the folder each time it is quiet, from now until `stop` (the ranks' life)."""
        if self.watcher is not None:
            self._stopping = asyncio.Event()
            self._task = asyncio.create_task(self._watch(self._stopping, every_s))

    async def stop(self) -> None:
        if self._task is not None:
            self._stopping.set()
            await self._task  # a commit under way finishes: the end's must not overlap it
            self._task = None

    async def _watch(self, stop: asyncio.Event, every_s: float) -> None:
        assert self.watcher is not None
        while not stop.is_set():
            self._follow(await asyncio.to_thread(self.watcher.poll))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), every_s)

    async def end(self, whole: bool, stopped: bool) -> None:
        """After the ranks: the last commit if they left the folder whole (they all returned),
        then the job's end line: `stopped` when it was asked to stop (the last commit stands,
        whether the script saved on the SIGTERM or died of it), `done` when the ranks finished
        by themselves. A crash writes neither: the run restarts from the last commit."""
        if whole and self.watcher is not None:
            self._follow(await asyncio.to_thread(self.watcher.final, None, FINAL_COMMIT_S))
        if self.fenced:
            return  # a later generation owns the run: this one neither finished nor stopped
        if stopped:
            reason = STOP_REASONS[ASKED_TO_STOP]
            self._write(event="stopped", step=self.committed, reason=reason)
        elif whole:
            self._write(event="done", step=self.committed)

    def _write(self, **event: object) -> None:
        # Opened for each line: the launch starts the file afresh after this object is made.
        with open(self.progress_file, "a") as handle:
            handle.write(json.dumps({"time": time.time(), **event}) + "\n")

    def _follow(self, poll: FolderPoll) -> None:
        if poll.skipped:
            log.warning("not committed from %s: %s", self.folder, poll.skipped)
        if poll.state is FolderState.COMMITTED and poll.commit is not None:
            self.committed = poll.commit.step
            self._write(event="checkpoint", step=self.committed)
            self._write(event="step", step=self.committed, checkpoint_step=self.committed)
        elif poll.state in (FolderState.BUSY, FolderState.TORN, FolderState.LOST):
            log.info("%s not committed yet: %s (%s)", self.folder, poll.state.value, poll.why)
        elif poll.state is FolderState.FENCED:
            log.warning(
                "%s: a later generation has started; nothing more is committed", self.folder
            )
