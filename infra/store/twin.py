"""A store with a twin site: the primary serves, the twin stands in when the primary is down.

What reaches the twin, and when:

- Committed checkpoints, dataset snapshots and code snapshots, and the small run records resume
  needs (the generation fences, the attempt ledgers), are copied there asynchronously by the
  replicator
  (`infra/replication.py`), files first and manifest last, as on the primary.
- While the primary is unreachable (`StoreUnavailable`), reads and writes go to the twin instead:
  training keeps committing checkpoints, resume and evaluation read what the twin has.

So an object may live on either site. Reads try the primary, then the twin (an object the
primary lacks may have been written during an outage); listings are the union of both. Keys
under `runs/` and `datasets/` name immutable content (a step's files, a snapshot's shards) or
records written by one generation, so the same key on both sites holds the same bytes, and the
primary's copy wins where both answer.

After a failure the primary is left alone for `retry_after_s`: every request would otherwise pay
botocore's retries (seconds) before falling back. A read that the twin cannot answer, and any
listing, asks the primary even then, once a bare connection to it gets through (at most one
probe a second): only the primary may hold the object, and it may be back.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from infra.errors import NotOnTwin, ObjectNotFound, StoreError, StoreUnavailable
from infra.store.protocol import ObjectStore

T = TypeVar("T")


class TwinStore:
    def __init__(
        self,
        primary: ObjectStore,
        twin: ObjectStore,
        retry_after_s: float = 30.0,
        probe_every_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.primary = primary
        self.twin = twin
        self.url = primary.url  # where the data belongs: what records and messages name
        self.twin_url = twin.url
        self._retry_after_s = retry_after_s
        self._clock = clock
        self._primary_down_until = 0.0
        self._probe_every_s = probe_every_s
        self._last_probe = -probe_every_s

    @property
    def primary_down(self) -> bool:
        return self._clock() < self._primary_down_until

    def _on_primary(self, operation: Callable[[ObjectStore], T]) -> T:
        """Run `operation` on the primary; StoreUnavailable if it is (or just went) down."""
        if self.primary_down:
            raise StoreUnavailable(f"{self.primary.url} is down (retrying it later)")
        try:
            return operation(self.primary)
        except StoreUnavailable:
            self._primary_down_until = self._clock() + self._retry_after_s
            raise

    def _read(self, key: str, operation: Callable[[ObjectStore], T]) -> T:
        presumed_down = self.primary_down
        try:
            return self._on_primary(operation)
        except (StoreUnavailable, ObjectNotFound) as primary_error:
            try:
                return operation(self.twin)
            except ObjectNotFound:
                if not presumed_down:
                    raise self._neither_has(key, primary_error) from None
            # Only the primary can have it (written there since the outage, or never copied),
            # and the primary was only presumed down: ask it now rather than fail a read that
            # it may answer (an agent's first job after the primary came back, say). But only
            # once a bare connection gets through: during a real outage every absent key (a new
            # run's fence, a manifest not yet written) would otherwise pay botocore's retries.
            if not self._primary_is_back():
                raise self._neither_has(key, primary_error) from None
            self._primary_down_until = 0.0
            return self._on_primary(operation)

    def _neither_has(self, key: str, primary_error: StoreError) -> StoreError:
        """What a read that neither site answered raises: the primary's ObjectNotFound as it is
        (the object is nowhere), its outage as NotOnTwin (the object may well exist)."""
        if isinstance(primary_error, ObjectNotFound):
            return primary_error
        return NotOnTwin(
            f"{key} is not on the twin {self.twin.url} and the primary {self.primary.url} is "
            "down: it may be copied there, or the primary return, later"
        )

    def _primary_is_back(self) -> bool:
        """A probe of the presumed-down primary, at most one per `probe_every_s` (a black-holed
        site costs the probe's timeout, not a refused connection's microseconds)."""
        now = self._clock()
        if now - self._last_probe < self._probe_every_s:
            return False
        self._last_probe = now
        return self.primary.reachable()

    def _write(self, operation: Callable[[ObjectStore], T]) -> T:
        try:
            return self._on_primary(operation)
        except StoreUnavailable:
            return operation(self.twin)

    # Writes: the primary, or the twin while the primary is down.

    def put_bytes(self, key: str, data: bytes) -> None:
        self._write(lambda store: store.put_bytes(key, data))

    def put_file(self, key: str, path: Path) -> None:
        self._write(lambda store: store.put_file(key, path))

    def put_if_absent(self, key: str, data: bytes) -> bool:
        return self._write(lambda store: store.put_if_absent(key, data))

    def delete(self, key: str) -> None:
        """Gone from both sites; a site that is down keeps its copy (pruning retries later, and
        a leftover old checkpoint costs space, not correctness)."""
        reached = False
        sites: list[Callable[[], None]] = [
            lambda: self._on_primary(lambda store: store.delete(key)),
            lambda: self.twin.delete(key),
        ]
        for delete in sites:
            with contextlib.suppress(StoreUnavailable):
                delete()
                reached = True
        if not reached:
            raise StoreUnavailable(f"neither {self.primary.url} nor {self.twin.url} answers")

    # Reads: the primary, then the twin.

    def get_bytes(self, key: str) -> bytes:
        return self._read(key, lambda store: store.get_bytes(key))

    def get_file(self, key: str, dest: Path) -> None:
        self._read(key, lambda store: store.get_file(key, dest))

    def digest(self, key: str) -> tuple[int, str]:
        return self._read(key, lambda store: store.digest(key))

    def claimed_digest(self, key: str) -> tuple[int, str]:
        return self._read(key, lambda store: store.claimed_digest(key))

    def reachable(self) -> bool:
        return self.primary.reachable() or self.twin.reachable()

    def exists(self, key: str) -> bool:
        with contextlib.suppress(StoreUnavailable):
            if self._on_primary(lambda store: store.exists(key)):
                return True
        return self.twin.exists(key)

    def list(self, prefix: str) -> list[str]:
        keys: set[str] = set()
        if self.primary_down and self._primary_is_back():
            # A listing of the twin alone misses what only the primary holds (a checkpoint
            # committed since the outage ended): the control worker's, left presumed down for
            # retry_after_s after a heal, found step 40 of a run that had committed 60.
            self._primary_down_until = 0.0
        try:
            keys.update(self._on_primary(lambda store: store.list(prefix)))
        except StoreUnavailable:
            keys.update(self.twin.list(prefix))  # the twin down too: nothing to list from
            return sorted(keys)
        # The primary answered: what the twin adds is only an outage's writes.
        with contextlib.suppress(StoreUnavailable):
            keys.update(self.twin.list(prefix))
        return sorted(keys)
