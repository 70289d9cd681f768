"""A dataset snapshot: the deduplicated corpus as tokenizer + token shards + one manifest.

The snapshot id is a hash of the source contents, the settings and the dataprep version, so the
same corpus prepared the same way is found in the store and reused instead of rebuilt. The
manifest is written last, with create-if-absent: a snapshot without one does not exist.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

from dataprep.dedup import DedupStats, exact_dedup
from dataprep.errors import EmptyCorpusError
from dataprep.readers import SplitRule, check_sources, read_documents
from dataprep.shards import ShardWriter, is_validation, token_dtype
from dataprep.tokenizer import TokenizerKind, build_tokenizer, end_of_document_id
from infra.digest import sha256_bytes, sha256_file
from infra.errors import IntegrityError
from infra.store import ObjectStore

# Bump when the same input and settings would produce different bytes: old snapshots then stop
# matching instead of being reused with a stale layout.
DATAPREP_VERSION = 1
MANIFEST_FORMAT = "forgeline.dataset/1"
_ENCODE_BATCH = 1024

Progress = Callable[[str], None]


@dataclass(frozen=True)
class SnapshotSettings:
    split: SplitRule = "blank-line"
    tokenizer: TokenizerKind = "char"
    val_fraction: float = 0.1
    shard_tokens: int = 1 << 20


@dataclass(frozen=True)
class Snapshot:
    snapshot_id: str
    manifest_key: str
    manifest_sha256: str
    manifest: dict
    reused: bool


def snapshot_id(sources: list[Path], settings: SnapshotSettings) -> str:
    digest = hashlib.sha256()
    digest.update(f"dataprep-v{DATAPREP_VERSION}\n".encode())
    digest.update(json.dumps(asdict(settings), sort_keys=True).encode())
    for path in sources:
        digest.update(sha256_file(path).encode())
    return digest.hexdigest()[:20]


def manifest_key(snapshot: str) -> str:
    return f"datasets/{snapshot}/MANIFEST.json"


def prepare_snapshot(
    sources: list[Path],
    settings: SnapshotSettings,
    store: ObjectStore,
    progress: Progress = lambda _: None,
) -> Snapshot:
    check_sources(sources)
    snapshot = snapshot_id(sources, settings)
    key = manifest_key(snapshot)
    if store.exists(key):
        data = store.get_bytes(key)
        progress(f"snapshot {snapshot} exists; reusing it")
        return Snapshot(snapshot, key, sha256_bytes(data), json.loads(data), reused=True)

    stats = DedupStats()
    documents = []
    for path in sources:
        progress(f"reading {path}")
        documents.extend(exact_dedup(read_documents(path, settings.split), stats))
    if not documents:
        raise EmptyCorpusError(
            f"no documents in {', '.join(map(str, sources))} with split rule "
            f"{settings.split!r}: check the files and data.split"
        )
    progress(f"{stats.seen} documents, {stats.removed} exact duplicates removed")

    tokenizer = build_tokenizer(settings.tokenizer, documents)
    eod = end_of_document_id(tokenizer)
    dtype = token_dtype(tokenizer.get_vocab_size())
    prefix = f"datasets/{snapshot}"
    with tempfile.TemporaryDirectory(prefix="forgeline-snapshot-") as tmp:
        folder = Path(tmp)
        writers = {
            split: ShardWriter(folder, split, settings.shard_tokens, dtype)
            for split in ("train", "val")
        }
        counts = {"train": 0, "val": 0}
        for start in range(0, len(documents), _ENCODE_BATCH):
            batch = documents[start : start + _ENCODE_BATCH]
            for doc, encoding in zip(batch, tokenizer.encode_batch(batch), strict=True):
                split = "val" if is_validation(doc, settings.val_fraction) else "train"
                writers[split].add([*encoding.ids, eod])
                counts[split] += 1
            progress(f"tokenized {min(start + _ENCODE_BATCH, len(documents))}/{len(documents)}")
        for split, count in counts.items():
            if count == 0:
                raise EmptyCorpusError(
                    f"the {split} split is empty ({len(documents)} documents, val_fraction "
                    f"{settings.val_fraction}): add data or change data.val_fraction"
                )

        tokenizer_path = folder / "tokenizer.json"
        tokenizer.save(str(tokenizer_path))
        store.put_file(f"{prefix}/tokenizer.json", tokenizer_path)
        splits = {}
        for split, writer in writers.items():
            files = writer.close()
            for shard in files:
                store.put_file(f"{prefix}/{shard.path.name}", shard.path)
            splits[split] = {
                "documents": counts[split],
                "tokens": writer.tokens,
                "shards": [
                    {**_file_entry(f"{prefix}/{s.path.name}", s.path, s.sha256), "tokens": s.tokens}
                    for s in files
                ],
            }
        manifest = {
            "format": MANIFEST_FORMAT,
            "snapshot_id": snapshot,
            "created_at": datetime.now(UTC).isoformat(),
            "dataprep_version": DATAPREP_VERSION,
            "sources": [{"path": str(p), **_file_entry(None, p)} for p in sources],
            "settings": asdict(settings),
            "documents": {"read": stats.seen, "duplicates_removed": stats.removed},
            "tokenizer": {
                "kind": settings.tokenizer,
                "vocab_size": tokenizer.get_vocab_size(),
                "end_of_document_id": eod,
                **_file_entry(f"{prefix}/tokenizer.json", tokenizer_path),
            },
            "dtype": dtype.name,
            "splits": splits,
        }
    data = json.dumps(manifest, indent=2, sort_keys=True).encode()
    created = store.put_if_absent(key, data)
    if not created:  # a concurrent run committed the same snapshot first: theirs is identical
        data = store.get_bytes(key)
        manifest = json.loads(data)
    progress(f"snapshot {snapshot} committed")
    return Snapshot(snapshot, key, sha256_bytes(data), manifest, reused=not created)


def _file_entry(key: str | None, path: Path, sha256: str | None = None) -> dict:
    entry = {"bytes": path.stat().st_size, "sha256": sha256 or sha256_file(path)}
    if key is not None:
        entry["key"] = key
    return entry


def load_manifest(store: ObjectStore, key: str, sha256: str) -> dict:
    """Read a dataset manifest and check it is the one the run was given."""
    data = store.get_bytes(key)
    actual = sha256_bytes(data)
    if actual != sha256:
        raise IntegrityError(
            f"dataset manifest {key} has sha256 {actual[:12]}…, expected {sha256[:12]}…: "
            "the snapshot was modified after the run started"
        )
    return json.loads(data)
