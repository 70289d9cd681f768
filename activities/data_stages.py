"""The data workers' work: the stages of `dataprep.snapshot` on one spec, one chunk at a time.

Plain functions that activities.data wraps as activities. Each returns at once when the snapshot
is already committed (a second run, or a retry after the commit, has nothing to do). This module
imports dataprep (DuckDB, pyarrow, datasketch: forgeline[data]); activities.data loads it only
when a data worker starts.
"""

from __future__ import annotations

from pathlib import Path

from dataprep import stage_runner
from dataprep.dedup_stage import DEDUP
from dataprep.filters import FilterSettings
from dataprep.minhash import MinHashSettings
from dataprep.plan import plan_snapshot
from dataprep.readers import ReaderSettings
from dataprep.scan import SCAN
from dataprep.settings import DedupSettings, SnapshotSettings, TokenizerSettings
from dataprep.snapshot import (
    Progress,
    Snapshot,
    commit_snapshot,
    existing_snapshot,
    load_plan,
    save_plan,
)
from dataprep.source_roots import DataRoots
from dataprep.stage_runner import Stage
from dataprep.tokenize_stage import TOKENIZE, TOKENIZER
from infra.store.protocol import ObjectStore
from workflows.contracts.models import DatasetInput, DatasetPlanRef, DatasetRef, DataStageInput
from workflows.contracts.spec import DataSpec

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
    documents = manifest.documents
    return DatasetRef(
        snapshot_id=snapshot.snapshot_id,
        manifest_key=snapshot.manifest_key,
        manifest_sha256=snapshot.manifest_sha256,
        vocab_size=manifest.tokenizer.vocab_size,
        train_tokens=manifest.splits["train"].tokens,
        val_tokens=manifest.splits["val"].tokens,
        documents=documents.read,
        duplicates_removed=documents.exact_duplicates + documents.near_duplicates,
        filtered=documents.filtered,
        reused=snapshot.reused,
        bytes=manifest.tokenizer.bytes
        + sum(shard.bytes for split in manifest.splits.values() for shard in split.shards),
    )


# The stages by activity name; each runs once per snapshot (chunk None) or per chunk.
STAGES: dict[str, Stage] = {
    "scan_chunk": SCAN,
    "dedup_dataset": DEDUP,
    "train_tokenizer": TOKENIZER,
    "tokenize_chunk": TOKENIZE,
}


def plan_dataset(store: ObjectStore, inp: DatasetInput, roots: DataRoots) -> DatasetPlanRef:
    # `store:` sources name objects of this worker's store, which is the run's; local ones
    # must lie in this worker's data roots.
    snapshot_plan = plan_snapshot(inp.data.sources, snapshot_settings(inp.data), store.url, roots)
    found = existing_snapshot(store, snapshot_plan.snapshot_id)
    if found is not None:
        return DatasetPlanRef(
            snapshot_id=snapshot_plan.snapshot_id,
            chunks=len(snapshot_plan.chunks),
            existing=dataset_ref(found),
        )
    save_plan(store, snapshot_plan)
    return DatasetPlanRef(snapshot_id=snapshot_plan.snapshot_id, chunks=len(snapshot_plan.chunks))


def run_stage(
    store: ObjectStore, stage: str, inp: DataStageInput, workdir: Path, progress: Progress
) -> None:
    if existing_snapshot(store, inp.snapshot_id) is not None:
        return
    snapshot_plan = load_plan(store, inp.snapshot_id)
    settings = snapshot_settings(inp.data)
    stage_runner.run_stage(
        STAGES[stage], store, snapshot_plan, settings, workdir, progress, inp.chunk
    )


def commit(
    store: ObjectStore, inp: DataStageInput, workdir: Path, progress: Progress
) -> DatasetRef:
    if (found := existing_snapshot(store, inp.snapshot_id)) is not None:
        return dataset_ref(found)
    snapshot_plan = load_plan(store, inp.snapshot_id)
    return dataset_ref(
        commit_snapshot(store, snapshot_plan, snapshot_settings(inp.data), workdir, progress)
    )
