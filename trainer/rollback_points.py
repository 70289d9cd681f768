"""The checkpoints a corruption verdict may roll back to, kept from pruning.

When a node that raised a suspect (trainer.spike_watch) is later quarantined for corruption,
the run resumes from the last checkpoint committed before that node's first suspect step
(workflows.suspect_rollback). By then `keep_checkpoints` (2 by default) newer ones may have been
committed, and pruning would have deleted it: on the local stack a run rolled back that way
started again from step 0. So rank 0 pins (trainer.run_identity.pin: never pruned) the
checkpoints committed before a suspect step as soon as the suspect is seen, and any that
commits later from a step before it (a save still uploading when the suspect was judged).
The store is only listed, not read: a suspect costs one LIST and a small PUT per pin.
"""

from __future__ import annotations

import contextlib

from infra.store.door import DoorFenced
from infra.store.protocol import ObjectStore
from trainer.manifest import commits
from trainer.run_identity import pin


class RollbackPoints:
    def __init__(self, store: ObjectStore, run_id: str, generation: int) -> None:
        self.store = store
        self.run_id = run_id
        self.generation = generation
        self._before = 0  # the latest suspect step seen: commits from before it are kept

    def suspect_at(self, step: int) -> None:
        """A rank was suspect at `step`: keep every checkpoint committed before it."""
        if step <= self._before:
            return  # what a later suspect keeps includes an earlier one's
        self._before = step
        for commit in commits(self.store, self.run_id):
            mine = commit.generation is None or commit.generation <= self.generation
            if commit.step < step and mine:
                self._pin(commit.key, commit.step, commit.generation or 0)

    def committed(self, key: str, step: int) -> None:
        """A manifest was just committed (before pruning runs)."""
        if step < self._before:
            self._pin(key, step, self.generation)

    def _pin(self, key: str, step: int, generation: int) -> None:
        """Pinned under this generation. A boxed rank's door refuses a generation superseded
        meanwhile every write: the newer generation keeps what its own rollbacks need."""
        with contextlib.suppress(DoorFenced):
            pin(self.store, self.run_id, key, step, generation, pinned_by=self.generation)
