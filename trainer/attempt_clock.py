"""Where one generation's wall time went: rank 0's ledger of an attempt, kept in the store.

Goodput needs facts the workflow cannot see: when the ranks were ready to train (spawn,
rendezvous and checkpoint load are done), how much of each step was checkpoint stall,
evaluation or waiting for a straggler, and how far the ranks got after their last commit
before they died. Heartbeats are throttled and the last ones before a crash are lost, so rank 0
writes this ledger to `runs/<run>/attempts/gen-<g>.json` instead: at the first step, at every
commit, at the end, and at most once a second in between. A background thread does the writing
(newest wins), so a slow store never stalls a step. A SIGKILL loses at most the last second.

Times are wall-clock (`time.time()`), comparable with the workflow's clock on the same network.
The ledger is a typed stored record (`version` 1; ledgers from before name none).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from typing import Any, ClassVar

from pydantic import BaseModel, Field

from infra.processes import started_at
from infra.store.protocol import ObjectStore
from infra.stored_format import StoredRecord

FLUSH_EVERY_S = 1.0


def ledger_key(run_id: str, generation: int) -> str:
    return f"runs/{run_id}/attempts/gen-{generation}.json"


class Totals(BaseModel):
    """Running sums since the ranks were ready, in seconds of wall time."""

    steps: int = 0
    train_s: float = 0.0  # step time, checkpoint stall and evaluation taken out
    stall_s: float = 0.0  # the loop blocked on a checkpoint (staging copy, waiting for a save)
    eval_s: float = 0.0  # in-training evaluation
    straggler_s: float = 0.0  # part of train_s spent waiting for the slowest rank
    shadow_s: float = 0.0  # part of train_s spent on shadow checks (trainer.shadow_check)
    # Part of train_s a pipeline's ranks idled (its schedule's share); left out where none,
    # so a ledger written before pipelines is written back as it was.
    bubble_s: float = Field(0.0, exclude_if=lambda seconds: seconds == 0.0)

    def plus(self, **seconds: float) -> Totals:
        return Totals(**{k: getattr(self, k) + seconds.get(k, 0) for k in Totals.model_fields})


class Mark(BaseModel):
    """The totals at the end of one step: what a checkpoint of that step secures."""

    step: int
    at: float
    totals: Totals


class Ledger(StoredRecord):
    """One generation's attempt as rank 0 saw it, kept at `ledger_key`."""

    VERSION_FIELD: ClassVar[str] = "version"
    VERSIONS: ClassVar[tuple[Any, ...]] = (1,)
    WHAT: ClassVar[str] = "attempt ledger"

    version: int = 1
    run_id: str
    generation: int
    resume_step: int
    process_started_at: float
    ready_at: float | None = None  # model built, checkpoint loaded: the first step starts
    load_s: float = 0.0  # of which reading the checkpoint
    commits: list[Mark] = Field(default_factory=list)  # committed steps of this generation
    last: Mark | None = None  # the newest step finished
    ended: str | None = None  # done, stopped (why), failed (why); None while it runs
    # When the rank's process started, before its imports (None off Linux): what a restart
    # spends in the interpreter's start and `import torch` is process_started_at - spawned_at.
    spawned_at: float | None = None

    @classmethod
    def _unversioned(cls) -> Any:
        return 1  # written before ledgers named their version


class AttemptClock:
    """Rank 0 keeps it (the other ranks pass enabled=False and it does nothing)."""

    def __init__(
        self,
        store: ObjectStore,
        run_id: str,
        generation: int,
        resume_step: int,
        process_started_at: float,
        enabled: bool,
    ) -> None:
        self.enabled = enabled
        self.ledger = Ledger(run_id=run_id, generation=generation, resume_step=resume_step,
                             process_started_at=process_started_at,
                             spawned_at=started_at(os.getpid()))  # fmt: skip
        self.totals = Totals()
        self._pending: dict[int, Mark] = {}  # saves issued, not yet committed
        self._writer = _NewestWins(store, ledger_key(run_id, generation)) if enabled else None
        self._flushed_at = 0.0

    def ready(self, load_s: float) -> None:
        self.ledger.ready_at = time.time()
        self.ledger.load_s = load_s
        self._flush(force=True)

    def step_done(self, step: int, **seconds: float) -> None:
        self.totals = self.totals.plus(steps=1, **seconds)
        self.ledger.last = Mark(step=step, at=time.time(), totals=self.totals)
        self._flush()

    def save_issued(self, step: int) -> None:
        """Called once `step` is finished and its checkpoint is on its way."""
        self._pending[step] = Mark(step=step, at=time.time(), totals=self.totals)

    def add(self, **seconds: float) -> None:
        """Time after the step's mark: its evaluation, its checkpoint's stall."""
        self.totals = self.totals.plus(**seconds)

    def committed(self, step: int) -> None:
        mark = self._pending.pop(step, None)
        if mark is not None:
            self.ledger.commits.append(mark)
            self._flush(force=True)

    def end(self, how: str) -> None:
        self.ledger.ended = how
        if self.ledger.last is not None:
            self.ledger.last = Mark(step=self.ledger.last.step, at=time.time(), totals=self.totals)
        self._flush(force=True)
        if self._writer is not None:
            self._writer.close()

    def _flush(self, force: bool = False) -> None:
        if self._writer is None or (not force and time.time() - self._flushed_at < FLUSH_EVERY_S):
            return
        self._flushed_at = time.time()
        self._writer.put(self.ledger.model_dump_json().encode())


def read_ledger(store: ObjectStore, run_id: str, generation: int) -> Ledger | None:
    key = ledger_key(run_id, generation)
    if not store.exists(key):
        return None
    return Ledger.parse(store.get_bytes(key), key)


class _NewestWins:
    """One background thread puts the newest version of one object; older unwritten versions
    are dropped. close() waits for the newest to land."""

    def __init__(self, store: ObjectStore, key: str) -> None:
        self._store = store
        self._key = key
        self._newest: bytes | None = None
        self._closed = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="attempt-ledger", daemon=True)
        self._thread.start()

    def put(self, data: bytes) -> None:
        with self._cond:
            self._newest = data
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._newest is not None or self._closed)
                data, self._newest = self._newest, None
                if data is None:
                    return
            # Accounting must never take the training down: a failed put waits for the next.
            with contextlib.suppress(Exception):
                self._store.put_bytes(self._key, data)
