"""The stages' done-records as typed formats: records a worker of the build before wrote (no
version field) still load, so an upgrade in the middle of a preparation redoes nothing; a
record this build cannot read is refused naming its key and field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dataprep.dedup_stage import DedupRecord
from dataprep.scan import ScanRecord
from dataprep.stage_store import StageRecord, commit_record, done_record, file_entry
from dataprep.tokenize_stage import TokenizeRecord, TokenizerRecord
from infra.store.local import LocalStore
from infra.stored_format import StoredFormatError

# Each stage's record from one preparation of a three-document corpus with the code before the
# records were typed (written with that build's scan, dedup, tokenizer and tokenize stages).
STORED = Path(__file__).parent / "stored" / "stage-records-v1"
KINDS: dict[str, type[StageRecord]] = {
    "scan": ScanRecord,
    "dedup": DedupRecord,
    "tokenizer": TokenizerRecord,
    "tokenize": TokenizeRecord,
}


@pytest.mark.parametrize("stage", sorted(KINDS))
def test_a_record_written_before_the_types_loads_and_writes_back_the_same(stage: str) -> None:
    raw = (STORED / f"{stage}.json").read_text()
    record = KINDS[stage].parse(raw, f"work/{stage}/DONE.json")
    assert record.version == 1 and record.files
    assert record.dump() == {**json.loads(raw), "version": 1}


def test_the_figures_are_typed() -> None:
    scan = ScanRecord.parse((STORED / "scan.json").read_bytes(), "scan")
    assert (scan.records, scan.documents, scan.kept) == (4, 4, 4)
    tokenize = TokenizeRecord.parse((STORED / "tokenize.json").read_bytes(), "tokenize")
    tail = tokenize.tails["train"]
    assert tail is not None and tail.tokens == tokenize.tokens["train"] == 112
    assert tokenize.tails["val"] is None and tokenize.shards["train"] == []
    vocab = TokenizerRecord.parse((STORED / "tokenizer.json").read_bytes(), "tokenizer")
    assert vocab.kind == "char" and vocab.end_of_document_id < vocab.vocab_size


def test_a_stage_is_done_only_when_its_record_s_files_verify(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    (tmp_path / "tokenizer.json").write_text('{"model": {}}')
    entry = file_entry(store, "work/tokenizer/tokenizer.json", tmp_path / "tokenizer.json")
    record = TokenizerRecord(kind="char", vocab_size=64, end_of_document_id=3,
                             files={"tokenizer": entry})  # fmt: skip
    assert commit_record(store, "work/tokenizer/DONE.json", record) == record
    assert done_record(store, "work/tokenizer/DONE.json", TokenizerRecord) == record
    store.put_bytes(entry.key, b"{}")  # the file changed after its record: redo the stage
    assert done_record(store, "work/tokenizer/DONE.json", TokenizerRecord) is None
    assert done_record(store, "work/dedup/DONE.json", DedupRecord) is None  # never ran


def test_a_record_this_build_cannot_read_is_refused_by_key_and_field(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    newer = {**json.loads((STORED / "scan.json").read_text()), "version": 2}
    store.put_bytes("work/scan/chunk-00000.json", json.dumps(newer).encode())
    with pytest.raises(StoredFormatError, match=r"work/scan/chunk-00000\.json: .*version 2"):
        done_record(store, "work/scan/chunk-00000.json", ScanRecord)
    broken = json.loads((STORED / "dedup.json").read_text())
    del broken["near_removed"]
    store.put_bytes("work/dedup/DONE.json", json.dumps(broken).encode())
    with pytest.raises(StoredFormatError, match="field 'near_removed': field required"):
        done_record(store, "work/dedup/DONE.json", DedupRecord)
