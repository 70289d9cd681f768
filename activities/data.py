"""Activities of the data workers: the stages of `dataprep.snapshot`, one chunk at a time.

Synchronous (they run in the worker's thread pool) and CPU-bound; each heartbeats the stage's
progress messages, and each returns at once when the snapshot is already committed (a second
run, or a retry after the commit, has nothing to do).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from temporalio import activity

from activities.errors import domain_errors
from activities.heartbeat import keep_alive
from dataprep.dedup_stage import dedup_snapshot
from dataprep.filters import FilterSettings
from dataprep.minhash import MinHashSettings
from dataprep.plan import plan_snapshot
from dataprep.readers import ReaderSettings
from dataprep.scan import scan_chunk
from dataprep.settings import DedupSettings, SnapshotSettings, TokenizerSettings
from dataprep.snapshot import (
    Snapshot,
    commit_snapshot,
    existing_snapshot,
    load_plan,
    save_plan,
)
from dataprep.tokenize_stage import tokenize_chunk, train_tokenizer
from infra.settings import Settings
from workflows.models import DatasetInput, DatasetPlanRef, DatasetRef, DataStageInput
from workflows.spec import DataSpec

_MB = 1 << 20


def snapshot_settings(data: DataSpec) -> SnapshotSettings:
    """The run spec's [data] table as dataprep's settings (field names are the same)."""
    dedup = data.dedup
    return SnapshotSettings(
        reader=ReaderSettings(
            split=data.split, text_field=data.text_field, max_bad_fraction=data.max_bad_fraction
        ),
        filters=FilterSettings(**data.filters.model_dump()),
        dedup=DedupSettings(
            exact=dedup.exact,
            near=dedup.near,
            minhash=MinHashSettings(ngram=dedup.ngram, bands=dedup.bands, rows=dedup.rows),
            verify=dedup.verify,
            threshold=dedup.threshold,
            memory_limit=dedup.memory_limit,
        ),
        tokenizer=TokenizerSettings(
            kind=data.tokenizer,
            vocab_size=data.vocab_size,
            train_bytes=data.tokenizer_train_mb * _MB,
        ),
        val_fraction=data.val_fraction,
        shard_tokens=data.shard_tokens,
        chunk_bytes=data.chunk_mb * _MB,
    )


def dataset_ref(snapshot: Snapshot) -> DatasetRef:
    manifest = snapshot.manifest
    documents = manifest["documents"]
    return DatasetRef(
        snapshot_id=snapshot.snapshot_id,
        manifest_key=snapshot.manifest_key,
        manifest_sha256=snapshot.manifest_sha256,
        vocab_size=manifest["tokenizer"]["vocab_size"],
        train_tokens=manifest["splits"]["train"]["tokens"],
        val_tokens=manifest["splits"]["val"]["tokens"],
        documents=documents["read"],
        duplicates_removed=documents["exact_duplicates"] + documents["near_duplicates"],
        filtered=documents["filtered"],
        reused=snapshot.reused,
    )


class DataActivities:
    def __init__(self, settings: Settings, worker_name: str = "data") -> None:
        self.store = settings.open_store()
        self.workdir = settings.home / "data-work" / worker_name

    def _workdir(self, snapshot_id: str) -> Path:
        return self.workdir / snapshot_id

    @activity.defn(name="plan_dataset")
    def plan_dataset(self, inp: DatasetInput) -> DatasetPlanRef:
        with domain_errors(), keep_alive():
            plan = plan_snapshot(inp.data.sources, snapshot_settings(inp.data))
            found = existing_snapshot(self.store, plan.snapshot_id)
            if found is not None:
                return DatasetPlanRef(
                    snapshot_id=plan.snapshot_id,
                    chunks=len(plan.chunks),
                    existing=dataset_ref(found),
                )
            save_plan(self.store, plan)
        return DatasetPlanRef(snapshot_id=plan.snapshot_id, chunks=len(plan.chunks))

    @activity.defn(name="scan_chunk")
    def scan_chunk(self, inp: DataStageInput) -> None:
        self._run(inp, scan_chunk)

    @activity.defn(name="dedup_dataset")
    def dedup_dataset(self, inp: DataStageInput) -> None:
        self._run(inp, dedup_snapshot)

    @activity.defn(name="train_tokenizer")
    def train_tokenizer(self, inp: DataStageInput) -> None:
        self._run(inp, train_tokenizer)

    @activity.defn(name="tokenize_chunk")
    def tokenize_chunk(self, inp: DataStageInput) -> None:
        self._run(inp, tokenize_chunk)

    @activity.defn(name="commit_dataset")
    def commit_dataset(self, inp: DataStageInput) -> DatasetRef:
        with domain_errors(), keep_alive():
            if (found := existing_snapshot(self.store, inp.snapshot_id)) is not None:
                return dataset_ref(found)
            plan = load_plan(self.store, inp.snapshot_id)
            snapshot = commit_snapshot(
                self.store,
                plan,
                snapshot_settings(inp.data),
                self._workdir(inp.snapshot_id),
                activity.heartbeat,
            )
        return dataset_ref(snapshot)

    def _run(self, inp: DataStageInput, stage: Callable[..., object]) -> None:
        with domain_errors(), keep_alive():
            if existing_snapshot(self.store, inp.snapshot_id) is not None:
                return
            plan = load_plan(self.store, inp.snapshot_id)
            settings = snapshot_settings(inp.data)
            workdir = self._workdir(inp.snapshot_id)
            if inp.chunk is None:
                stage(self.store, plan, settings, workdir, activity.heartbeat)
            else:
                stage(self.store, plan, inp.chunk, settings, workdir, activity.heartbeat)

    def all(self) -> list:
        return [
            self.plan_dataset,
            self.scan_chunk,
            self.dedup_dataset,
            self.train_tokenizer,
            self.tokenize_chunk,
            self.commit_dataset,
        ]
