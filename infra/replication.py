"""Asynchronous replication to the twin site: what a committed checkpoint or snapshot needs there.

One pass (`Replicator.run_once`) copies, from the primary to the twin:

- every committed unit, i.e. a folder with a `MANIFEST.json` (a checkpoint's `step-N/`, a dataset
  snapshot's root): its other objects first, each checked by sha256, then the manifest, with a
  create-if-absent put. The contract of the primary holds on the twin too: no manifest, no
  checkpoint, and a manifest there means every file it lists is there. A folder without a
  manifest is a save in flight, or one that died: it is not copied.
- the small run records that resume and accounting read (`runs/<run>/generations/`,
  `runs/<run>/attempts/`, the run's identity claim and its pinned checkpoints), whenever they
  differ, and before the units: a run resuming from the twin finds its claim beside its
  checkpoints, never checkpoints that nobody seems to own (trainer.run_identity).

Nothing is deleted by replication: pruning deletes on both sites (`TwinStore.delete`), and
objects that only the twin has were written there while the primary was down.

Lag is measured per unit: when the copy of its manifest landed on the twin, minus the
`committed_at` (checkpoint) or `created_at` (an older snapshot) its manifest records; a
manifest with no time in it (a dataset snapshot's is a pure function of its inputs, so that
concurrent commits write the same bytes) counts from the start of the pass that copied it, a
lower bound. The pass writes a
status object (`replication/status.json`) to the twin, where it can be read while the primary is
down; `forgeline replication` prints it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from infra.errors import ObjectNotFound, StoreError, StoreUnavailable
from infra.store.protocol import ObjectStore

MANIFEST = "MANIFEST.json"
STATUS_KEY = "replication/status.json"
# The units that carry a manifest, and the records copied as they change.
# Committed units, each files first and manifest last: dataset snapshots, checkpoints, and the
# users' code snapshots (a run resuming from the twin fetches its code there too).
_UNIT = re.compile(
    r"^(datasets/[^/]+|runs/[^/]+/checkpoints/step-\d+(/gen-\d+)?|code/[0-9a-f]+)/MANIFEST\.json$"
)
# A checkpoint of the former layout is the folder `step-N/` itself; the generation folders that
# a later run put beside its files are units of their own.
_FORMER_CHECKPOINT = re.compile(r"/checkpoints/step-\d+/$")
# And the control plane's settings: the approval rules and the decision key, which the gate and
# the API read while the primary is down.
_RECORD = re.compile(
    r"^(runs/[^/]+/((generations|attempts|pins)/[^/]+|identity\.json)"
    r"|settings/(approvals\.json|decision-key))$"
)
_SKIPPED_IN_UNIT = "/work/"  # a snapshot's staging area: dropped when it commits
_RECENT = 20  # replicated units kept in the status, newest first


@dataclass
class Replicated:
    manifest_key: str
    committed_at: str
    replicated_at: str
    lag_s: float
    objects: int
    bytes: int


@dataclass
class ReplicationStatus:
    primary: str
    twin: str
    updated_at: str
    primary_reachable: bool = True
    pending: list[str] = field(default_factory=list)  # committed units not yet on the twin
    recent: list[Replicated] = field(default_factory=list)
    max_lag_s: float = 0.0  # of the units replicated by this replicator so far
    error: str = ""

    @classmethod
    def read(cls, twin: ObjectStore) -> ReplicationStatus | None:
        try:
            data = json.loads(twin.get_bytes(STATUS_KEY))
        except ObjectNotFound:
            return None
        data["recent"] = [Replicated(**r) for r in data.get("recent", [])]
        return cls(**data)


def _now() -> datetime:
    return datetime.now(UTC)


class Replicator:
    def __init__(
        self,
        primary: ObjectStore,
        twin: ObjectStore,
        scratch: Path,
        clock: Callable[[], datetime] = _now,
    ) -> None:
        self.primary = primary
        self.twin = twin
        self.scratch = scratch
        self.clock = clock
        self._pass_started = clock()  # what a manifest with no time of its own is measured from
        # Units known to be complete on the twin: manifests never change once committed.
        self._done: set[str] = set()
        # Each record's (size, sha256) as last copied: a record unchanged on the primary costs
        # one HEAD there, not one on each site, every pass.
        self._records: dict[str, tuple[int, str]] = {}
        self._recent: list[Replicated] = []
        self._max_lag_s = 0.0
        # Units whose manifest reached the twin but whose prune check on the primary did not
        # answer (the primary dropped off the network between the two): confirmed, and listed
        # in the status, on the first pass that reaches the primary again.
        self._unconfirmed: dict[str, tuple[Replicated, list[str]]] = {}

    def run_once(self) -> ReplicationStatus:
        """One pass; the status it wrote to the twin. Never raises for a primary that is down."""
        status = ReplicationStatus(self.primary.url, self.twin.url, "")
        self._pass_started = self.clock()
        try:
            keys = self.primary.list("")
            for key in keys:
                if _RECORD.match(key):
                    self._record(key)
            units = [k for k in keys if _UNIT.match(k) and k not in self._done]
            for manifest_key in units:
                self._unit(manifest_key, keys)
            status.pending = [k for k in units if k not in self._done]
        except StoreUnavailable as err:
            status.primary_reachable = False
            status.error = str(err)
        except StoreError as err:  # one bad object must not stop replication for good
            status.error = str(err)
        status.recent = self._recent[:_RECENT]
        status.max_lag_s = self._max_lag_s
        status.updated_at = self.clock().isoformat()
        self.twin.put_bytes(STATUS_KEY, json.dumps(asdict(status), indent=1).encode())
        return status

    def _unit(self, manifest_key: str, keys: list[str]) -> None:
        folder = manifest_key.removesuffix(MANIFEST)
        if manifest_key in self._unconfirmed:
            self._confirm(manifest_key)
            return
        if self.twin.exists(manifest_key):
            self._done.add(manifest_key)  # copied by an earlier replicator
            return
        nested = folder + "gen-" if _FORMER_CHECKPOINT.search(folder) else None
        members = [
            k
            for k in keys
            if k.startswith(folder)
            and k != manifest_key
            and _SKIPPED_IN_UNIT not in k
            and not (nested and k.startswith(nested))
        ]
        try:
            manifest = self.primary.get_bytes(manifest_key)
            copied = sum(self._copy(key) for key in members)
        except ObjectNotFound:  # pruned on the primary while we copied: nothing to keep
            self._withdraw(manifest_key, members)
            return
        self.twin.put_if_absent(manifest_key, manifest)
        landed = self.clock()
        committed = _commit_time(manifest) or self._pass_started
        entry = Replicated(
            manifest_key=manifest_key,
            committed_at=committed.isoformat(),
            replicated_at=landed.isoformat(),
            lag_s=max(0.0, (landed - committed).total_seconds()),
            objects=len(members) + 1,
            bytes=copied + len(manifest),
        )
        self._unconfirmed[manifest_key] = (entry, members)
        self._confirm(manifest_key)

    def _confirm(self, manifest_key: str) -> None:
        """List a unit whose manifest is on the twin, unless it was pruned on the primary
        meanwhile (then the twin's copies go too). Raises StoreUnavailable, and keeps the unit
        unconfirmed, when the primary cannot answer."""
        entry, members = self._unconfirmed[manifest_key]
        if not self.primary.exists(manifest_key):  # pruned just now, the twin's copies too
            self._withdraw(manifest_key, members)
        else:
            self._recent.insert(0, entry)
            self._max_lag_s = max(self._max_lag_s, entry.lag_s)
            self._done.add(manifest_key)
        del self._unconfirmed[manifest_key]

    def _withdraw(self, manifest_key: str, members: list[str]) -> None:
        """Take back a unit that was pruned while it was being copied: the prune deleted the
        twin's copies it found, but an object read from the primary just before may have
        landed on the twin after (manifest first: no manifest, no checkpoint)."""
        for key in [manifest_key, *members]:
            with contextlib.suppress(ObjectNotFound):
                self.twin.delete(key)

    def _record(self, key: str) -> None:
        try:
            current = self.primary.claimed_digest(key)
            if self._records.get(key) == current:
                return
            if self.twin.exists(key) and self.twin.claimed_digest(key) == current:
                self._records[key] = current
                return
            data = self.primary.get_bytes(key)
            self.twin.put_bytes(key, data)
            self._records[key] = (len(data), hashlib.sha256(data).hexdigest())
        except ObjectNotFound:
            return

    def _copy(self, key: str) -> int:
        """Copy one object unless the twin holds the same bytes; the bytes it moved. The
        stores' claimed digests decide (one HEAD each, not a read of every byte of both
        sites): the copy's download hashes the primary's bytes, and readers of the twin hash
        what they read."""
        size, sha256 = self.primary.claimed_digest(key)
        try:
            if self.twin.claimed_digest(key) == (size, sha256):
                return 0
        except ObjectNotFound:
            pass
        self.scratch.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=self.scratch) as tmp:
            local = Path(tmp) / "object"
            self.primary.get_file(key, local)
            self.twin.put_file(key, local)
        if self.twin.claimed_digest(key) != (size, sha256):
            raise StoreError(f"{self.twin.url}/{key} does not match the primary after copying")
        return size


def _commit_time(manifest: bytes) -> datetime | None:
    try:
        data = json.loads(manifest)
        stamp = data.get("committed_at") or data.get("created_at")
        return datetime.fromisoformat(stamp) if stamp else None
    except (ValueError, TypeError, AttributeError):
        return None
