"""Stages 3 and 4: train the tokenizer on the deduplicated corpus, then tokenize each chunk
into fixed-size token shards (each document followed by end-of-document)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from tokenizers import Tokenizer

from dataprep.dataset_manifest import Shard
from dataprep.dedup_stage import NEEDS_DEDUP, NEEDS_EVERY_SCAN, DedupRecord
from dataprep.plan import SnapshotPlan
from dataprep.scan import ScanRecord
from dataprep.shards import ShardFile, ShardWriter, token_dtype
from dataprep.stage_runner import Needs, Stage, StageRun, chunk_folder
from dataprep.stage_store import SnapshotKeys, StageRecord, chunk_name, file_entry, local_copy
from dataprep.tokenizer import build_tokenizer, end_of_document_id
from infra.store.protocol import ObjectStore

Progress = Callable[[str], None]
SPLITS = ("train", "val")
_BATCH = 1024


class TokenizerRecord(StageRecord):
    """The tokenizer, trained. Files: `tokenizer` (the tokenizers library's JSON)."""

    kind: str  # "bpe" or "char"
    vocab_size: int
    end_of_document_id: int


class TokenizeRecord(StageRecord):
    """One chunk tokenized into full shards (in the snapshot's place already) and, per split,
    the chunk's last partly filled shard (merged with the other chunks' at commit). Files:
    `tokens` (tokens per document) and every shard by its file name."""

    chunk: int
    documents: dict[str, int]  # by split
    tokens: dict[str, int]  # by split
    shards: dict[str, list[Shard]]  # full shards, by split
    tails: dict[str, Shard | None]  # the partial last shard, by split


NEEDS_TOKENIZER = Needs("tokenizer", TokenizerRecord, "tokenizer training")
NEEDS_EVERY_TOKENIZE = Needs("tokenize", TokenizeRecord, "tokenizing", every_chunk=True)


def _kept_texts(
    con: duckdb.DuckDBPyConnection, docs: list[Path], removed: Path, where: str = "TRUE"
) -> Iterator[pa.RecordBatch]:
    """Kept documents (not removed by dedup) in doc_id order, i.e. source order."""
    files = "[" + ", ".join(f"'{p}'" for p in docs) + "]"
    yield from con.sql(
        f"""
        SELECT d.doc_id, d.split, d.text FROM read_parquet({files}) d
        ANTI JOIN read_parquet('{removed}') r ON d.doc_id = r.doc_id
        WHERE {where} ORDER BY d.doc_id
        """
    ).to_arrow_reader(_BATCH)


def _train_tokenizer(run: StageRun) -> TokenizerRecord:
    """Learn the vocabulary from the kept documents (BPE: of the train split, up to a budget)."""
    docs = [run.local(r.files["docs"]) for r in run.records("scan", ScanRecord)]
    removed = run.local(run.record("dedup", DedupRecord).files["removed"])
    config = run.settings.tokenizer
    con = run.duckdb()

    def texts() -> Iterator[str]:
        # BPE learns from the train split only (val stays unseen); a char vocabulary covers
        # every kept document so validation text has no unknown characters.
        where = "d.split = 'train'" if config.kind == "bpe" else "TRUE"
        budget = config.train_bytes if config.kind == "bpe" else float("inf")
        seen = 0
        for batch in _kept_texts(con, docs, removed, where):
            for text in batch.column("text").to_pylist():
                yield text
                seen += len(text)
                if seen >= budget:
                    return

    run.progress(f"training the {config.kind} tokenizer")
    tokenizer = build_tokenizer(config.kind, texts(), config.vocab_size)
    path = run.folder("tokenizer") / "tokenizer.json"
    tokenizer.save(str(path))
    record = TokenizerRecord(
        kind=config.kind,
        vocab_size=tokenizer.get_vocab_size(),
        end_of_document_id=end_of_document_id(tokenizer),
        files={"tokenizer": run.upload(run.keys.work("tokenizer", "tokenizer.json"), path)},
    )
    run.progress(f"{config.kind} tokenizer: {record.vocab_size} tokens")
    return record


TOKENIZER = Stage(
    "tokenizer", TokenizerRecord, _train_tokenizer, needs=(NEEDS_EVERY_SCAN, NEEDS_DEDUP)
)


def _tokenize(run: StageRun) -> TokenizeRecord:
    """Encode the chunk's kept documents into full shards (each document ends with
    end-of-document) and keep its last, partly filled shard per split apart."""
    assert run.chunk is not None
    index, settings, store, keys = run.chunk, run.settings, run.store, run.keys
    name = chunk_name(index)
    vocab = run.record("tokenizer", TokenizerRecord)
    tokenizer = Tokenizer.from_file(str(run.local(vocab.files["tokenizer"])))
    eod = vocab.end_of_document_id
    dtype = token_dtype(vocab.vocab_size)
    docs = run.local(run.record("scan", ScanRecord).files["docs"])
    removed = run.local(run.record("dedup", DedupRecord).files["removed"])

    folder = chunk_folder(run, "tokenize")
    writers = {s: ShardWriter(folder, f"{s}-{name}", settings.shard_tokens, dtype) for s in SPLITS}
    documents = dict.fromkeys(SPLITS, 0)
    counted: dict[str, list] = {"doc_id": [], "tokens": []}
    con = run.duckdb()
    for batch in _kept_texts(con, [docs], removed):
        rows = batch.to_pydict()
        for doc_id, split, encoding in zip(
            rows["doc_id"], rows["split"], tokenizer.encode_batch_fast(rows["text"]), strict=True
        ):
            ids = encoding.ids
            ids.append(eod)
            writers[split].add(ids)
            documents[split] += 1
            counted["doc_id"].append(doc_id)
            counted["tokens"].append(len(ids))
    tokens_path = folder / "tokens.parquet"
    pq.write_table(
        pa.table(counted, schema=pa.schema([("doc_id", pa.int64()), ("tokens", pa.int64())])),
        tokens_path,
    )

    files = {"tokens": run.upload(keys.work("tokenize", f"tokens-{name}.parquet"), tokens_path)}
    shards: dict[str, list[Shard]] = {}
    tails: dict[str, Shard | None] = {}
    for split, writer in writers.items():
        written = writer.close()
        full = [s for s in written if s.tokens == settings.shard_tokens]
        partial = [s for s in written if s.tokens < settings.shard_tokens]
        shards[split] = []
        for shard in full:
            stored = _stored_shard(store, keys.shard(shard.path.name), shard)
            shards[split].append(stored)
            files[shard.path.name] = stored
        tails[split] = None
        for shard in partial:  # at most one: the chunk's last, partly filled shard
            stored = _stored_shard(store, keys.work("tokenize", shard.path.name), shard)
            tails[split] = stored
            files[shard.path.name] = stored
    record = TokenizeRecord(
        chunk=index,
        documents=documents,
        tokens={s: writers[s].tokens for s in SPLITS},
        shards=shards,
        tails=tails,
        files=files,
    )
    run.progress(f"chunk {index}: {sum(record.tokens.values())} tokens")
    return record


TOKENIZE = Stage(
    "tokenize",
    TokenizeRecord,
    _tokenize,
    per_chunk=True,
    needs=(
        Needs("scan", ScanRecord, "scan", per_chunk=True),
        NEEDS_DEDUP,
        NEEDS_TOKENIZER,
    ),
)


def merge_tails(
    store: ObjectStore,
    plan: SnapshotPlan,
    records: list[TokenizeRecord],
    dtype: np.dtype,
    shard_tokens: int,
    workdir: Path,
) -> dict[str, list[Shard]]:
    """Pack every chunk's partial last shard, in chunk order, into full shards (the very last
    one of each split may stay partial): the snapshot's only shards that are not full."""
    keys = SnapshotKeys(plan.snapshot_id)
    cache = workdir / "cache"
    folder = workdir / "tails"
    folder.mkdir(parents=True, exist_ok=True)
    merged: dict[str, list[Shard]] = {}
    for split in SPLITS:
        writer = ShardWriter(folder, f"{split}-tail", shard_tokens, dtype)
        for record in records:
            tail = record.tails[split]
            if tail is not None:
                writer.add(np.fromfile(local_copy(store, tail, cache), dtype=dtype))
        merged[split] = [_stored_shard(store, keys.shard(s.path.name), s) for s in writer.close()]
    return merged


def _stored_shard(store: ObjectStore, key: str, shard: ShardFile) -> Shard:
    """Upload a written shard to `key`, described as a manifest lists it."""
    return Shard(**file_entry(store, key, shard.path).model_dump(), tokens=shard.tokens)
