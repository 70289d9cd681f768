"""The node agent's watch over a script's checkpoint folder: commit it each time it is quiet.

A script that never imports Forgeline says nothing when it has saved. The agent polls
(`FolderWatcher.poll`, every second or so while the ranks run) and commits the folder when it
has changed since the last commit and then been quiet: no file's stamp (size, mtime, inode)
changed for `settle_s`, and no process holds one of its files open for writing. A file still
being written (under its final name or a temporary one) keeps the folder busy, so it is never
committed half; a save that lands while the folder is copied makes the copy torn, and it is
dropped for the next quiet moment. After the ranks exit (or the preemption's grace runs out),
`final` commits what they left without waiting for the settle period.

The step of a commit is the script's if it reported one (the caller passes it), else one more
than the last committed step: the commits count the script's progress.
"""

from __future__ import annotations

import os
import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from infra.store.protocol import ObjectStore
from trainer.folder_checkpoint import (
    CommitTarget,
    FolderCommit,
    TornSnapshot,
    commit_snapshot,
    copy_snapshot,
)
from trainer.folder_scan import FileStamp, FolderScan, open_for_writing, scan_folder
from trainer.manifest import CommitOutcome

SETTLE_S = 2.0  # how long a changed folder stays untouched before it is committed


class FolderState(Enum):
    UNCHANGED = "nothing written since the last commit"
    SETTLING = "written less than the settle period ago"
    BUSY = "a file is still open for writing"
    TORN = "written while it was copied: waits for the next quiet moment"
    EMPTY = "no file to commit"
    COMMITTED = "committed"
    LOST = "this generation had already committed that step"
    FENCED = "a later generation has started: nothing more is committed"


@dataclass(frozen=True)
class FolderPoll:
    state: FolderState
    commit: FolderCommit | None = None  # where a commit went (COMMITTED, LOST, FENCED)
    why: str = ""  # the writers (BUSY), what changed (TORN)
    skipped: dict[str, str] = field(default_factory=dict)  # never committed: name and why


class FolderWatcher:
    """One generation's watch over `folder`. What is there when it starts (a restored
    checkpoint, or nothing) counts as committed, at `last_step`."""

    def __init__(
        self,
        folder: Path,
        staging: Path,
        store: ObjectStore,
        target: CommitTarget,
        last_step: int,
        settle_s: float = SETTLE_S,
        keep: int | None = None,
        meta: Callable[[], dict[str, Any]] = dict,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.folder, self.staging, self.store, self.target = folder, staging, store, target
        if staging.resolve().is_relative_to(folder.resolve()):
            raise ValueError(f"staging {staging} is inside the watched folder {folder}")
        self.last_step = last_step
        self.settle_s = settle_s
        self.keep = keep
        # Where each manifest's more fields come from (tokens_seen, world_size, ...), asked at
        # every commit: what they say changes as the run goes on (add_meta).
        self._meta: list[Callable[[], dict[str, Any]]] = [meta]
        self.fenced = False
        self._clock = clock
        self._verified: set[str] = set()  # pruning's cache
        self._committed = scan_folder(folder).signature()
        self._seen: dict[str, FileStamp] | None = self._committed
        self._changed_at = clock()

    def add_meta(self, more: Callable[[], dict[str, Any]]) -> None:
        """From now on, each manifest also carries the fields `more` returns at its commit
        (over those of the sources given before, where they name the same field)."""
        self._meta.append(more)

    def _manifest_fields(self) -> dict[str, Any]:
        fields: dict[str, Any] = {}
        for source in self._meta:
            fields.update(source())
        return fields

    def poll(self, step: int | None = None, settled: bool = False) -> FolderPoll:
        """Commit the folder if it changed and has been quiet for the settle period; `step`:
        the step the script last reported, if it did. `settled`: the script's library said its
        save is complete (forgeline.integrations): no settle period to wait for."""
        if self.fenced:
            return FolderPoll(FolderState.FENCED)
        scan = scan_folder(self.folder)
        now, signature = self._clock(), scan.signature()
        if signature != self._seen:
            self._seen, self._changed_at = signature, now
        if signature == self._committed:
            return FolderPoll(FolderState.UNCHANGED, skipped=scan.skipped)
        quiet = settled or now - self._changed_at >= self.settle_s
        if not quiet and not self._written_before_settling(scan):
            return FolderPoll(FolderState.SETTLING, skipped=scan.skipped)
        return self._commit(scan, step)

    def _written_before_settling(self, scan: FolderScan) -> bool:
        """No file changed (by the files' own ctimes) for a settle period. A script that saves
        more often than the agent polls changes the folder between every two polls, so the
        folder never looks quiet from one poll to the next; between its saves it is."""
        newest = max((f.stamp.ctime_ns for f in scan.files.values()), default=0)
        return time.time_ns() - newest >= self.settle_s * 1e9

    def final(
        self, step: int | None = None, timeout_s: float = 30.0, unchanged_too: bool = False
    ) -> FolderPoll:
        """Commit what the ranks left, now that they have exited: no settle period, but a file
        a straggling process still writes is waited for, a settle period at a time, up to
        `timeout_s`. `unchanged_too`: commit at `step` even if nothing changed since the last
        commit (the script went on reporting steps after its last save was committed)."""
        deadline = self._clock() + timeout_s
        while True:
            if self.fenced:
                return FolderPoll(FolderState.FENCED)
            scan = scan_folder(self.folder)
            if scan.signature() == self._committed and not unchanged_too:
                return FolderPoll(FolderState.UNCHANGED, skipped=scan.skipped)
            outcome = self._commit(scan, step)
            # A step the script named and this generation already committed stays taken.
            again = outcome.state in (FolderState.BUSY, FolderState.TORN) or (
                outcome.state is FolderState.LOST and step is None
            )
            if not again or self._clock() + self.settle_s > deadline:
                return outcome
            time.sleep(self.settle_s)

    def _commit(self, scan: FolderScan, step: int | None) -> FolderPoll:
        if not scan.files:
            return FolderPoll(FolderState.EMPTY, skipped=scan.skipped)
        if writers := open_for_writing(scan):
            held = ", ".join(f"{w.name} (pid {w.pid})" for w in writers[:5])
            return FolderPoll(FolderState.BUSY, why=f"open for writing: {held}")
        staging = self.staging / f"snapshot-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            snapshot = copy_snapshot(self.folder, scan, staging)
        except TornSnapshot as torn:
            self._seen = None  # the next poll sees a change, and waits a settle period again
            return FolderPoll(FolderState.TORN, why=str(torn), skipped=scan.skipped)
        at = self.last_step + 1 if step is None else step
        try:
            commit = commit_snapshot(
                self.store,
                snapshot,
                self.target,
                at,
                self._manifest_fields(),
                self.keep,
                self._verified,
            )
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        if commit.fenced:
            self.fenced = True
            return FolderPoll(FolderState.FENCED, commit)
        self.last_step = max(self.last_step, at)
        if commit.outcome is CommitOutcome.ALREADY_THERE:  # the next try takes the next step
            return FolderPoll(FolderState.LOST, commit, why=f"{commit.key} was already there")
        self._committed = snapshot.signature
        return FolderPoll(FolderState.COMMITTED, commit, skipped=scan.skipped)
