"""One runner for every data-preparation stage, in datatrove's spirit: a stage declares what it
reads (the records of earlier stages) and what it leaves (its record type and key); the runner
does the rest once, for all of them.

    done already? (its record is there and its files verify) → that record, nothing redone
    the declared inputs, each required and verified (a missing one: the stages ran out of order)
    the stage's body, with a `StageRun`: its inputs, scratch folders, a DuckDB connection that
        spills under the work folder, local copies of stored files, uploads
    its record, written last and create-if-absent (a concurrent attempt's record stands)

Stages live in their own modules (`scan`, `dedup_stage`, `tokenize_stage`) with their records;
this module knows none of them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Generic, TypeVar

import duckdb

from dataprep.near_dedup import connect
from dataprep.plan import SnapshotPlan
from dataprep.settings import SnapshotSettings
from dataprep.stage_store import (
    SnapshotKeys,
    StageRecord,
    chunk_name,
    commit_record,
    done_record,
    file_entry,
    local_copy,
    required_record,
)
from infra.store.protocol import ObjectStore
from infra.stored_format import StoredFile

Progress = Callable[[str], None]
Record = TypeVar("Record", bound=StageRecord)


@dataclass(frozen=True)
class Needs:
    """A record a stage reads: an earlier stage's, that stage's one record, or per chunk
    either every chunk's (`every_chunk`) or the running chunk's."""

    stage: str
    record: type[StageRecord]
    what: str  # for the message when it is missing: "deduplication"
    every_chunk: bool = False
    per_chunk: bool = False


@dataclass(frozen=True)
class Stage(Generic[Record]):
    name: str  # its folder under work/: "scan", "dedup", "tokenizer", "tokenize"
    record: type[Record]
    body: Callable[[StageRun], Record]
    per_chunk: bool = False
    needs: tuple[Needs, ...] = ()

    def record_key(self, keys: SnapshotKeys, chunk: int | None) -> str:
        if self.per_chunk:
            assert chunk is not None, f"the {self.name} stage runs per chunk"
            return keys.chunk_record(self.name, chunk)
        return keys.work(self.name, "DONE.json")


@dataclass(frozen=True)
class Inputs:
    """The records a stage (or the commit) declared it reads, each required and verified."""

    found: dict[str, list[StageRecord]]

    @classmethod
    def read(
        cls, store: ObjectStore, plan: SnapshotPlan, needs: tuple[Needs, ...], chunk: int | None
    ) -> Inputs:
        keys = SnapshotKeys(plan.snapshot_id)
        return cls({need.stage: _required(store, keys, plan, need, chunk) for need in needs})

    def records(self, stage: str, kind: type[Record]) -> list[Record]:
        """`stage`'s records, in chunk order where it runs per chunk."""
        found = self.found[stage]
        assert all(isinstance(r, kind) for r in found), (stage, kind)
        return found  # type: ignore[return-value]

    def record(self, stage: str, kind: type[Record]) -> Record:
        (one,) = self.records(stage, kind)
        return one


@dataclass
class StageRun:
    """What a stage's body works with."""

    store: ObjectStore
    plan: SnapshotPlan
    settings: SnapshotSettings
    workdir: Path  # the snapshot's work folder on this worker
    progress: Progress
    chunk: int | None
    # Where sources in a bucket are copied to: beside the work folder by default, so that a
    # data worker's snapshots share the copies.
    source_cache: Path
    inputs: Inputs = field(default_factory=lambda: Inputs({}))
    _con: duckdb.DuckDBPyConnection | None = None

    @property
    def keys(self) -> SnapshotKeys:
        return SnapshotKeys(self.plan.snapshot_id)

    def records(self, stage: str, kind: type[Record]) -> list[Record]:
        return self.inputs.records(stage, kind)

    def record(self, stage: str, kind: type[Record]) -> Record:
        return self.inputs.record(stage, kind)

    def folder(self, *parts: str) -> Path:
        """A scratch folder of this stage's under the work folder."""
        path = self.workdir.joinpath(*parts)
        path.mkdir(parents=True, exist_ok=True)
        return path

    def local(self, entry: StoredFile) -> Path:
        """A stored file as a local path (the store's own file on a local store), verified."""
        return local_copy(self.store, entry, self.workdir / "cache")

    def upload(self, key: str, path: Path) -> StoredFile:
        return file_entry(self.store, key, path)

    def duckdb(self) -> duckdb.DuckDBPyConnection:
        """One connection per stage run, within the memory limit, spilling under workdir."""
        if self._con is None:
            memory = self.settings.dedup.memory_limit
            self._con = connect(memory, self.workdir / "duckdb-spill")
        return self._con


def run_stage(
    stage: Stage[Record],
    store: ObjectStore,
    plan: SnapshotPlan,
    settings: SnapshotSettings,
    workdir: Path,
    progress: Progress = lambda _: None,
    chunk: int | None = None,
    source_cache: Path | None = None,
) -> Record:
    """Run `stage` (for `chunk`, if it runs per chunk) unless its record says it is done.
    `source_cache`: where sources in a bucket are fetched to; by default beside `workdir` (a
    data worker gives each snapshot a workdir in its own folder, so its snapshots share the
    copies)."""
    keys = SnapshotKeys(plan.snapshot_id)
    key = stage.record_key(keys, chunk)
    if (done := done_record(store, key, stage.record)) is not None:
        where = f"chunk {chunk}" if stage.per_chunk else "the snapshot"
        progress(f"{stage.name} of {where} already done")
        return done
    run = StageRun(
        store, plan, settings, workdir, progress, chunk,
        source_cache=source_cache or workdir.parent / "source-cache",
        inputs=Inputs.read(store, plan, stage.needs, chunk),
    )  # fmt: skip
    return commit_record(store, key, stage.body(run))


def _required(
    store: ObjectStore, keys: SnapshotKeys, plan: SnapshotPlan, need: Needs, chunk: int | None
) -> list[StageRecord]:
    if need.every_chunk:
        chunks = [c.index for c in plan.chunks]
    elif need.per_chunk:
        assert chunk is not None, f"{need.stage}: read per chunk by a stage that is not"
        chunks = [chunk]
    else:
        return [required_record(store, keys.work(need.stage, "DONE.json"), need.record, need.what)]
    return [
        required_record(
            store, keys.chunk_record(need.stage, c), need.record, f"{need.what} of chunk {c}"
        )
        for c in chunks
    ]


def chunk_folder(run: StageRun, stage: str) -> Path:
    """The running chunk's scratch folder for `stage`: work/<stage>/<chunk>."""
    assert run.chunk is not None
    return run.folder(stage, chunk_name(run.chunk))
