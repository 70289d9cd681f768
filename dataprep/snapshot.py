"""A dataset snapshot: the cleaned, deduplicated corpus as tokenizer + token shards + manifest.

    plan → scan (per chunk) → dedup → tokenizer → tokenize (per chunk) → commit

Each stage is a function of the store and the plan, idempotent through its done-record, so the
same functions run in one process (`prepare_snapshot`, for tests and benchmarks) or fanned out
as Temporal activities over chunks (`activities/data.py`). The snapshot id hashes the source
contents, the settings and the dataprep version: the same corpus prepared the same way is found
and reused. The manifest is written last, with create-if-absent: without it there is no snapshot.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dataprep.dataset_manifest import (
    DatasetManifest,
    DocumentCounts,
    SourceFile,
    Split,
    TokenizerFile,
)
from dataprep.dedup_stage import DEDUP, NEEDS_DEDUP, NEEDS_EVERY_SCAN, DedupRecord
from dataprep.errors import EmptyCorpusError
from dataprep.near_dedup import connect
from dataprep.plan import DATAPREP_VERSION, SnapshotPlan, plan_snapshot
from dataprep.report import build_documents_table, summarize
from dataprep.scan import SCAN, ScanRecord
from dataprep.settings import SnapshotSettings
from dataprep.shards import token_dtype
from dataprep.stage_runner import Inputs, run_stage
from dataprep.stage_store import (
    SnapshotKeys,
    file_entry,
    local_copy,
)
from dataprep.tokenize_stage import (
    NEEDS_EVERY_TOKENIZE,
    NEEDS_TOKENIZER,
    SPLITS,
    TOKENIZE,
    TOKENIZER,
    TokenizeRecord,
    TokenizerRecord,
    merge_tails,
)
from infra.digest import sha256_bytes, sha256_file
from infra.errors import IntegrityError, ObjectNotFound
from infra.store.protocol import ObjectStore
from infra.stored_format import StoredFile

Progress = Callable[[str], None]


@dataclass(frozen=True)
class Snapshot:
    snapshot_id: str
    manifest_key: str
    manifest_sha256: str
    manifest: DatasetManifest
    reused: bool


def manifest_key(snapshot: str) -> str:
    return SnapshotKeys(snapshot).manifest


def existing_snapshot(store: ObjectStore, snapshot_id: str) -> Snapshot | None:
    key = manifest_key(snapshot_id)
    try:
        data = store.get_bytes(key)
    except ObjectNotFound:
        return None
    return Snapshot(
        snapshot_id, key, sha256_bytes(data), DatasetManifest.parse(data, key), reused=True
    )


def save_plan(store: ObjectStore, plan: SnapshotPlan) -> None:
    """Create-if-absent: the plan is a pure function of the sources and settings, so the same
    plan again (a retried activity) is fine. A different one under the same id is refused,
    not written over: the stages' records already made follow the plan stored first."""
    key = SnapshotKeys(plan.snapshot_id).plan
    data = plan.to_json()  # compared as JSON: a plan read back holds lists for tuples
    if store.put_if_absent(key, data) or load_plan(store, plan.snapshot_id).to_json() == data:
        return
    raise IntegrityError(
        f"{store.url}/{key} holds another plan of snapshot {plan.snapshot_id} (the same data "
        "from other paths or in other chunks, whose preparation has not committed): wait for "
        "it to commit (this run then reuses the snapshot), or delete that key to plan again"
    )


def load_plan(store: ObjectStore, snapshot_id: str) -> SnapshotPlan:
    """The plan stored under `snapshot_id`, refused (IntegrityError) unless its content hashes
    to that id: the stages read the sources it names."""
    key = SnapshotKeys(snapshot_id).plan
    try:
        plan = SnapshotPlan.from_json(store.get_bytes(key))
    except (ValueError, KeyError, TypeError) as err:
        raise IntegrityError(f"{store.url}/{key} is not a snapshot plan ({err})") from None
    if plan.snapshot_id != snapshot_id or not plan.named_by_its_content:
        raise IntegrityError(
            f"{store.url}/{key} is not the plan of snapshot {snapshot_id}: its sources and "
            "settings hash to another id (changed after it was written); delete the key to "
            "plan the snapshot again"
        )
    return plan


def prepare_snapshot(
    patterns: list[str],
    settings: SnapshotSettings,
    store: ObjectStore,
    workdir: Path,
    progress: Progress = lambda _: None,
) -> Snapshot:
    """Every stage in this process, in order (the Temporal workflow fans the same out)."""
    plan = plan_snapshot(patterns, settings, store.url)
    if (found := existing_snapshot(store, plan.snapshot_id)) is not None:
        progress(f"snapshot {plan.snapshot_id} exists; reusing it")
        return found
    save_plan(store, plan)
    run_every_stage(store, plan, settings, workdir, progress)
    return commit_snapshot(store, plan, settings, workdir, progress)


# The stages in their order: each reads only the records of those before it.
STAGES = (SCAN, DEDUP, TOKENIZER, TOKENIZE)


def run_every_stage(
    store: ObjectStore,
    plan: SnapshotPlan,
    settings: SnapshotSettings,
    workdir: Path,
    progress: Progress = lambda _: None,
) -> None:
    """Every stage but the commit, in this process, chunk after chunk."""
    for stage in STAGES:
        for chunk in [c.index for c in plan.chunks] if stage.per_chunk else [None]:
            run_stage(stage, store, plan, settings, workdir, progress, chunk)


def commit_snapshot(
    store: ObjectStore,
    plan: SnapshotPlan,
    settings: SnapshotSettings,
    workdir: Path,
    progress: Progress = lambda _: None,
) -> Snapshot:
    """Merge the tails, write the report and commit the manifest, last, create-if-absent.

    Two commits of one plan may run at once (an attempt that outlived its heartbeat timeout and
    its retry; two runs preparing the same corpus), and both return the same snapshot. The
    manifest and the files it names are functions of the work records, with no timestamp, so
    where the server has no conditional writes a second PUT rewrites the same bytes; the
    report, whose Parquet bytes depend on the DuckDB version, goes under keys of its sha256,
    so a later commit never changes what a committed manifest names. A commit that loses the
    race, or whose work records the winner dropped while it read them, returns the committed
    snapshot once every file of it verifies."""
    if (found := existing_snapshot(store, plan.snapshot_id)) is not None:
        return found
    keys = SnapshotKeys(plan.snapshot_id)
    try:
        data = _manifest(store, plan, settings, workdir, progress)
        store.put_if_absent(keys.manifest, data)
        stored = store.get_bytes(keys.manifest)
    except Exception:
        # The winner of a race drops the work records this commit may still be reading (a
        # missing file, object or record, however the reader words it): its snapshot stands.
        if (committed := _committed_elsewhere(store, plan.snapshot_id, progress)) is None:
            raise
        return committed
    if stored != data:  # another commit's manifest holds the key (other library versions)
        if (committed := _committed_elsewhere(store, plan.snapshot_id, progress)) is None:
            raise IntegrityError(
                f"{keys.manifest} was committed by another attempt, but a file it names is "
                "missing or does not match its sha256: delete the snapshot's folder and "
                "prepare it again"
            )
        return committed
    _drop_work(store, keys)
    progress(f"snapshot {plan.snapshot_id} committed")
    manifest = DatasetManifest.parse(data, keys.manifest)
    return Snapshot(plan.snapshot_id, keys.manifest, sha256_bytes(data), manifest, False)


def _manifest(
    store: ObjectStore,
    plan: SnapshotPlan,
    settings: SnapshotSettings,
    workdir: Path,
    progress: Progress,
) -> bytes:
    """The manifest's bytes, once every file it names is in the store. No commit time: the
    manifest is a function of the work records, byte for byte, whoever writes it."""
    keys = SnapshotKeys(plan.snapshot_id)
    cache = workdir / "cache"
    needs = (NEEDS_EVERY_SCAN, NEEDS_DEDUP, NEEDS_TOKENIZER, NEEDS_EVERY_TOKENIZE)
    inputs = Inputs.read(store, plan, needs, chunk=None)
    scans = inputs.records("scan", ScanRecord)
    dedup = inputs.record("dedup", DedupRecord)
    vocab = inputs.record("tokenizer", TokenizerRecord)
    tokenized = inputs.records("tokenize", TokenizeRecord)
    documents = {
        "records": sum(r.records for r in scans),
        "read": sum(r.documents for r in scans),
        "bad_records": sum(sum(r.bad.values()) for r in scans),
        "filtered": sum(sum(r.filtered.values()) for r in scans),
        "exact_duplicates": dedup.exact_removed,
        "near_duplicates": dedup.near_removed,
    }
    kept = {s: sum(t.documents[s] for t in tokenized) for s in SPLITS}
    _refuse_empty(kept, settings)

    dtype = token_dtype(vocab.vocab_size)
    tails = merge_tails(store, plan, tokenized, dtype, settings.shard_tokens, workdir)
    splits = {
        s: Split(
            documents=kept[s],
            tokens=sum(t.tokens[s] for t in tokenized),
            shards=[shard for t in tokenized for shard in t.shards[s]] + tails[s],
        )
        for s in SPLITS
    }
    tokenizer_path = local_copy(store, vocab.files["tokenizer"], cache)
    tokenizer = file_entry(store, keys.final("tokenizer.json"), tokenizer_path)

    progress("writing the report")
    con = connect(settings.dedup.memory_limit, workdir / "duckdb-spill")
    table = build_documents_table(
        con,
        docs=[local_copy(store, r.files["docs"], cache) for r in scans],
        rejected=[local_copy(store, r.files["rejected"], cache) for r in scans],
        removed=local_copy(store, dedup.files["removed"], cache),
        tokens=[local_copy(store, t.files["tokens"], cache) for t in tokenized],
        out=workdir / "documents.parquet",
    )
    report = {
        "snapshot_id": plan.snapshot_id,
        "documents": documents,
        "bad_records": _bad_records(scans),
        "dedup": dedup.model_dump(include={"candidate_pairs", "verified_pairs", "near_clusters"}),
        "dedup_examples": dedup.examples,
        **summarize(con, table),
    }
    report_json = workdir / "report.json"
    report_json.write_text(json.dumps(report, indent=2, default=str))
    manifest = DatasetManifest(
        snapshot_id=plan.snapshot_id,
        dataprep_version=DATAPREP_VERSION,
        settings=plan.identity,
        sources=[SourceFile(**f.manifest_entry()) for f in plan.files],
        documents=DocumentCounts(**documents, train=kept["train"], val=kept["val"]),
        tokenizer=TokenizerFile(
            kind=vocab.kind,
            vocab_size=vocab.vocab_size,
            end_of_document_id=vocab.end_of_document_id,
            **tokenizer.model_dump(),
        ),
        dtype=dtype.name,
        splits=splits,
        report={
            "documents": _report_entry(store, keys, table),
            "summary": _report_entry(store, keys, report_json),
        },
    )
    return manifest.dump_bytes()


def _report_entry(store: ObjectStore, keys: SnapshotKeys, path: Path) -> StoredFile:
    """Upload a report file under a key of its content: DuckDB's Parquet (its footer names the
    writer's version) may differ between two commits' hosts, and a fixed key would let the
    later one change the bytes the earlier one's committed manifest names."""
    return file_entry(store, keys.report(path.name, sha256_file(path)), path)


def _committed_elsewhere(
    store: ObjectStore, snapshot_id: str, progress: Progress
) -> Snapshot | None:
    """The snapshot another commit of this plan committed, if every file it names is there whole
    (as the store claims: readers hash the bytes when they fetch them)."""
    committed = existing_snapshot(store, snapshot_id)
    if committed is None:
        return None
    for entry in committed.manifest.files():
        try:
            if store.claimed_digest(entry.key) != (entry.bytes, entry.sha256):
                return None
        except ObjectNotFound:
            return None
    progress(f"snapshot {snapshot_id} was committed by another attempt; using it")
    return committed


def _refuse_empty(kept: dict[str, int], settings: SnapshotSettings) -> None:
    # Nothing read or nothing kept stopped the dedup stage already; an empty split is only
    # known now.
    if kept["train"] == 0:
        raise EmptyCorpusError(
            f"the train split is empty ({kept['val']} documents kept, all in val): add data "
            "or lower data.val_fraction"
        )
    if kept["val"] == 0:
        raise EmptyCorpusError(
            f"the val split is empty ({kept['train']} documents kept, val_fraction "
            f"{settings.val_fraction}): add data or raise data.val_fraction"
        )


def _bad_records(scans: list[ScanRecord]) -> dict:
    reasons: dict[str, int] = {}
    for record in scans:
        for reason, count in record.bad.items():
            reasons[reason] = reasons.get(reason, 0) + count
    examples = [e.model_dump() for record in scans for e in record.bad_examples][:20]
    return {"by_reason": reasons, "examples": examples}


def _drop_work(store: ObjectStore, keys: SnapshotKeys) -> None:
    """The intermediate files (texts, band index, partial shards) served their purpose."""
    for key in store.list(f"{keys.root}/work/"):
        store.delete(key)
