"""The node agent's half of a script that keeps its own checkpoints (level 1: it never imports
Forgeline): commit its checkpoint folder while the ranks run, and once more at their end.

The ranks write wherever the script saves (`FORGELINE_CHECKPOINT_DIR`, or the argument the spec
puts it in); trainer.folder_watch decides when the folder is quiet enough to commit. Each commit
becomes a checkpoint line in the ranks' progress file, written here for them, so heartbeats, the
cluster's view of what a preemption would lose, and the run's final step read as they do for
the SDK's runs. A commit's step is the newest the script reported (forgeline.report), or one
more than the last commit's: then the commits count the run's progress.

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
import functools
import json
import logging
import time
from pathlib import Path
from typing import Protocol

from trainer.folder_watch import FolderPoll, FolderState, FolderWatcher
from trainer.job import TrainJob
from trainer.stop_reasons import ASKED_TO_STOP, STOP_REASONS

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


class Reports(Protocol):
    """What the ranks reported (trainer.progress_tail.ProgressTail follows their lines)."""

    reported_step: int | None  # the newest step (forgeline.report)
    # The newest losses by step (the tail replaces its list on each report, never changes it:
    # kept as it is), and the newest held-out loss with its step.
    losses: list[tuple[int, float]]
    evaluated: tuple[int, float] | None
    saved_step: int | None  # the newest save its library said is complete


class ScriptFolder:
    """One generation's checkpoint folder on this node, as its ranks run."""

    def __init__(
        self,
        folder: Path,
        progress_file: Path,
        watcher: FolderWatcher | None,
        stop_file: Path,
        start_step: int = 0,
        poll_s: float = POLL_S,
    ) -> None:
        self.folder = folder
        self.poll_s = poll_s  # how often the watch looks at the folder while the ranks run
        self.watcher = watcher  # None: another node of the gang commits
        self.stop_file = stop_file
        self.progress_file = progress_file
        # The newest commit's step (the one the gang resumed from, to begin with): on a node
        # that does not commit, what its end line says unless its ranks reported a later one.
        self.committed = watcher.last_step if watcher is not None else start_step
        self._stopping = asyncio.Event()
        self._task: asyncio.Task | None = None
        # What the script reported (forgeline.report), as the launch's tail heard it.
        self._step: int | None = None
        self._losses: list[tuple[int, float]] = []
        self._evaluated: tuple[int, float] | None = None
        self._saved: int | None = None
        self._saved_tried: int | None = None  # the save the watch last committed without settling
        if watcher is not None:
            # Every commit's manifest also carries what the script reported: the run's
            # evaluation reads it there, as it does from the SDK's (trainer.reported_eval).
            watcher.add_meta(self._reported)

    def heard(self, reports: Reports) -> None:
        """What the script reported so far, as the launch's tail follows it."""
        self._step, self._losses = reports.reported_step, reports.losses
        self._evaluated, self._saved = reports.evaluated, reports.saved_step

    def _reported(self) -> dict[str, object]:
        found: dict[str, object] = {"loss_history": self._losses}
        if self._evaluated is not None:
            step, val_loss = self._evaluated
            found["evaluation"] = {"step": step, "val_loss": val_loss, "val_tokens": 0}
        return found

    def _commit_step(self) -> int | None:
        """The step a commit now is: the script's newest reported, if it reported one past
        the last commit; else None, one past the last commit (the commits count the run)."""
        last = self.watcher.last_step if self.watcher is not None else 0
        # A save said complete may be newer than the last report (a stop's save, between two
        # reports): the folder holds that step.
        newest = max((s for s in (self._step, self._saved) if s is not None), default=None)
        return newest if newest is not None and newest > last else None

    def _fresh_save(self) -> int | None:
        """The step of a save the library said is complete and no commit has taken yet: the
        folder is committed now, at that step, without a settle period. Tried once: if the
        folder is busy by then (the next save has begun), the settle period decides again,
        so a half-written next save is never committed under this one's step."""
        saved, last = self._saved, self.watcher.last_step if self.watcher is not None else 0
        if saved is None or saved <= last or saved == self._saved_tried:
            return None
        self._saved_tried = saved
        return saved

    @property
    def asked_to_stop(self) -> bool:
        """The agent was asked to checkpoint and stop (activities.node.stop_training)."""
        return self.stop_file.exists()

    @property
    def fenced(self) -> bool:
        return self.watcher is not None and self.watcher.fenced

    def start(self) -> None:
        """Commit the folder each time it is quiet, from now until `stop` (the ranks' life)."""
        if self.watcher is not None:
            self._stopping = asyncio.Event()
            self._task = asyncio.create_task(self._watch(self._stopping, self.poll_s))

    async def stop(self) -> None:
        if self._task is not None:
            self._stopping.set()
            await self._task  # a commit under way finishes: the end's must not overlap it
            self._task = None

    async def _watch(self, stop: asyncio.Event, every_s: float) -> None:
        assert self.watcher is not None
        while not stop.is_set():
            step, complete = self._commit_step(), self._fresh_save()
            if complete is not None:
                step = complete
            poll = functools.partial(self.watcher.poll, step, settled=complete is not None)
            self._follow(await asyncio.to_thread(poll))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), every_s)

    async def end(self, whole: bool, stopped: bool) -> None:
        """After the ranks: the last commit if they left the folder whole (they all returned),
        then the job's end line: `stopped` when it was asked to stop (the last commit stands,
        whether the script saved on the SIGTERM or died of it), `done` when the ranks finished
        by themselves. A crash writes neither: the run restarts from the last commit."""
        if whole and self.watcher is not None:
            # At the newest step the script reported, if past the last commit: what it left is
            # its state at the end, whether or not it saved again after that commit.
            step = self._commit_step()
            final = self.watcher.final
            self._follow(
                await asyncio.to_thread(final, step, FINAL_COMMIT_S, unchanged_too=step is not None)
            )
        if self.fenced:
            return  # a later generation owns the run: this one neither finished nor stopped
        # The gang's first node says the step it committed; another node, which commits
        # nothing, the newest its ranks reported (the same step: every rank steps together).
        step = self.committed if self.watcher is not None else max(self.committed, self._step or 0)
        if stopped:
            reason = STOP_REASONS[ASKED_TO_STOP]
            self._write(event="stopped", step=step, reason=reason)
        elif whole:
            self._write(event="done", step=step)

    def _write(self, **event: object) -> None:
        # Opened for each line: the launch starts the file afresh after this object is made.
        with open(self.progress_file, "a") as handle:
            handle.write(json.dumps({"time": time.time(), **event}) + "\n")

    def _follow(self, poll: FolderPoll) -> None:
        if poll.skipped:
            log.warning("not committed from %s: %s", self.folder, poll.skipped)
        if poll.state is FolderState.COMMITTED and poll.commit is not None:
            self.committed = poll.commit.step
            # A checkpoint line: for a script that reports no steps, the run's step too
            # (trainer.progress_tail.ProgressTail).
            self._write(event="checkpoint", step=self.committed, manifest_key=poll.commit.key)
        elif poll.state in (FolderState.BUSY, FolderState.TORN, FolderState.LOST):
            log.info("%s not committed yet: %s (%s)", self.folder, poll.state.value, poll.why)
        elif poll.state is FolderState.FENCED:
            log.warning(
                "%s: a later generation has started; nothing more is committed", self.folder
            )
