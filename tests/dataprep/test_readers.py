import gzip
import json
import random
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dataprep import readers, text_pieces
from dataprep.documents import BadRecord, Document, ReadStats
from dataprep.errors import BadRecordsError, SourceError
from dataprep.readers import (
    UNICODE_SPACES,
    ReaderSettings,
    SplitRule,
    read_source,
    split_documents,
)
from dataprep.sources import SourceFile

LENIENT = ReaderSettings(max_bad_fraction=1.0)


def read(
    path: Path, settings: ReaderSettings = LENIENT, language: str | None = None
) -> tuple[list[Document], ReadStats]:
    source = SourceFile(str(path), "text")
    name = path.name
    if name.endswith((".jsonl", ".jsonl.gz")):
        source = SourceFile(str(path), "jsonl")
    elif name.endswith(".parquet"):
        source = SourceFile(str(path), "parquet")
    elif language:
        source = SourceFile(str(path), "code", language)
    stats = ReadStats()
    return list(read_source(source, settings, stats)), stats


# --- text ---------------------------------------------------------------------------------

TEXT = b"\xef\xbb\xbfone\ntwo\n\n\nthree\n \t \nfour  \n\n"


@pytest.mark.parametrize(
    ("rule", "expected"),
    [
        ("blank-line", [("one\ntwo", 0), ("three", 1), ("four", 2)]),
        ("line", [("one", 0), ("two", 1), ("three", 2), ("four", 3)]),
        ("whole-file", [("one\ntwo\n\n\nthree\n \t \nfour", 0)]),
    ],
)
def test_text_split_rules(tmp_path: Path, rule: SplitRule, expected: list) -> None:
    path = tmp_path / "corpus.txt"
    path.write_bytes(TEXT)
    docs, stats = read(path, ReaderSettings(split=rule))
    assert [(d.text, d.position) for d in docs] == expected
    assert all(d.source == str(path) and d.kind == "text" for d in docs)
    assert (stats.records, stats.documents, sum(stats.bad.values())) == (len(docs), len(docs), 0)


def test_a_bad_byte_costs_one_document_and_positions_stay_stable(tmp_path: Path) -> None:
    path = tmp_path / "mixed.txt"
    path.write_bytes(b"first doc\n\n\nsecond \xff doc\nstill second\n\n  third doc\n")
    docs, stats = read(path)
    assert [(d.text, d.position) for d in docs] == [("first doc", 0), ("third doc", 2)]
    assert stats.examples == [BadRecord(str(path), 4, "not UTF-8")]
    assert (stats.records, stats.documents, stats.bad["not UTF-8"]) == (3, 2, 1)


def test_byte_splitting_cuts_where_text_splitting_does(tmp_path: Path) -> None:
    # Blank lines made of Unicode spaces, CRLF endings and form feeds are all whitespace.
    text = "a\r\n\r\nb\n\u3000\u2028\n\u00a0c\n\x0c\nd\u2003\ne\n"
    path = tmp_path / "spaces.txt"
    path.write_text(text, encoding="utf-8")
    for rule in ("blank-line", "line", "whole-file"):
        docs, _ = read(path, ReaderSettings(split=rule))
        assert [d.text for d in docs] == list(split_documents(text, rule)), rule
    assert list(split_documents(text, "blank-line")) == ["a", "b", "c", "d\u2003\ne"]


def test_unicode_spaces_are_exactly_pythons_whitespace() -> None:
    assert set(UNICODE_SPACES) == {chr(c) for c in range(0x110000) if chr(c).isspace()}


def test_missing_file_is_a_source_error(tmp_path: Path) -> None:
    with pytest.raises(SourceError, match=r"gone\.txt does not exist"):
        read(tmp_path / "gone.txt")


# --- JSONL --------------------------------------------------------------------------------

JSONL_LINES = [
    b'{"text": "good one", "id": 1}',
    b"",
    b"{not json",
    b"[1, 2]",
    b'{"body": "x"}',
    b'{"text": 7}',
    b'{"text": "   "}',
    b'{"text": "bad \xff byte"}',
    b'{"text": "lone \\ud800 surrogate"}',
    b'{"text": "  good two\\n"}',
]
JSONL_BAD = [
    (3, "invalid JSON"),
    (4, "not a JSON object"),
    (5, "missing field 'text'"),
    (6, "field 'text' is not a string"),
    (7, "empty text"),
    (8, "not UTF-8"),
    (9, "not UTF-8"),
]


def test_jsonl_records_and_every_bad_reason(tmp_path: Path) -> None:
    path = tmp_path / "c.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + b"\n".join(JSONL_LINES) + b"\n")
    docs, stats = read(path)
    assert [(d.text, d.position) for d in docs] == [("good one", 1), ("  good two\n", 10)]
    assert [(b.line, b.reason) for b in stats.examples] == JSONL_BAD
    assert (stats.records, stats.documents) == (9, 2)  # the blank line is no record


def test_jsonl_uses_the_configured_field(tmp_path: Path) -> None:
    path = tmp_path / "c.jsonl"
    path.write_text('{"content": "hello"}\n{"text": "no"}\n{"content": null}\n')
    docs, stats = read(path, ReaderSettings(text_field="content", max_bad_fraction=1.0))
    assert [d.text for d in docs] == ["hello"]
    assert [b.reason for b in stats.examples] == [
        "missing field 'content'",
        "field 'content' is not a string",
    ]


def test_gzipped_jsonl_and_a_truncated_one(tmp_path: Path) -> None:
    lines = b"".join(
        json.dumps({"text": f"document {i} " * 30}).encode() + b"\n" for i in range(400)
    )
    whole = gzip.compress(lines)
    path = tmp_path / "c.jsonl.gz"
    path.write_bytes(whole)
    docs, stats = read(path, ReaderSettings())
    assert len(docs) == 400 and docs[-1].position == 400 and not stats.bad

    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(whole[: len(whole) // 2])
    docs, stats = read(cut)
    assert 0 < len(docs) < 400
    assert [d.position for d in docs] == list(range(1, len(docs) + 1))  # all before the break
    assert stats.examples == [BadRecord(str(cut), len(docs) + 1, "truncated gzip")]
    with pytest.raises(BadRecordsError, match=rf"first at line {len(docs) + 1}: truncated gzip"):
        read(cut, ReaderSettings(max_bad_fraction=0.0))


def test_corrupt_gzip_is_one_bad_record(tmp_path: Path) -> None:
    path = tmp_path / "notgz.jsonl.gz"
    path.write_bytes(b'{"text": "plain, not gzip"}\n')
    docs, stats = read(path)
    assert docs == [] and stats.examples == [BadRecord(str(path), 1, "corrupt gzip")]


def test_overlong_record_is_skipped_without_losing_the_next(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(text_pieces, "MAX_RECORD_BYTES", 100)
    path = tmp_path / "long.jsonl"
    path.write_text(json.dumps({"text": "x" * 500}) + "\n" + json.dumps({"text": "ok"}) + "\n")
    docs, stats = read(path)
    assert [(d.text, d.position) for d in docs] == [("ok", 2)]
    assert [(b.line, b.reason) for b in stats.examples] == [(1, "record longer than 100 bytes")]


# --- Parquet ------------------------------------------------------------------------------


def test_parquet_rows_nulls_and_empties(tmp_path: Path) -> None:
    path = tmp_path / "c.parquet"
    texts = [f"row {i}" for i in range(2500)]
    texts[3], texts[2100] = None, "  "  # type: ignore[call-overload]
    table = pa.table({"id": list(range(2500)), "text": texts})
    pq.write_table(table, path, row_group_size=1000)
    docs, stats = read(path)
    assert len(docs) == 2498
    assert (docs[0].position, docs[3].text, docs[3].position) == (0, "row 4", 4)
    assert docs[-1].position == 2499 and docs[-1].text == "row 2499"
    assert [(b.line, b.reason) for b in stats.examples] == [
        (3, "field 'text' is null"),
        (2100, "empty text"),
    ]


def test_a_parquet_cell_over_the_record_cap_is_refused_like_a_jsonl_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before, a Parquet cell had no cap: a file of a few kB held megabytes of text in a cell
    (it compresses), while the same JSONL record was refused."""
    monkeypatch.setattr(text_pieces, "MAX_RECORD_BYTES", 100)
    path = tmp_path / "c.parquet"
    pq.write_table(pa.table({"text": ["ok", "x" * 500, "fine"]}), path, compression="zstd")
    docs, stats = read(path)
    assert [(d.text, d.position) for d in docs] == [("ok", 0), ("fine", 2)]
    assert [(b.line, b.reason) for b in stats.examples] == [(1, "document longer than 100 bytes")]


def test_parquet_batches_shrink_to_hold_wide_cells(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "wide.parquet"
    texts = [f"{i:04d}" + "y" * ((1 << 20) - 4) for i in range(40)]  # 40 MiB, a few kB on disk
    pq.write_table(pa.table({"text": texts}), path, compression="zstd", row_group_size=40,
                   use_dictionary=False)  # fmt: skip
    assert path.stat().st_size < 64 << 10
    monkeypatch.setattr(readers, "_PARQUET_BATCH_BYTES", 4 << 20)
    assert readers._batch_rows(pq.ParquetFile(path).metadata, "text") == 3  # not 1024
    docs, _ = read(path)
    assert len(docs) == 40 and {len(d.text) for d in docs} == {1 << 20}


def test_parquet_missing_or_non_string_column_fails_the_file(tmp_path: Path) -> None:
    path = tmp_path / "c.parquet"
    pq.write_table(pa.table({"body": ["a"], "n": [1]}), path)
    with pytest.raises(SourceError, match=r"c\.parquet has no column 'text' \(columns: body, n\)"):
        read(path)
    with pytest.raises(SourceError, match="column 'n' has type int64, not string"):
        read(path, ReaderSettings(text_field="n"))
    docs, _ = read(path, ReaderSettings(text_field="body"))
    assert [d.text for d in docs] == ["a"]


def test_parquet_bad_rows_over_the_limit_name_the_row(tmp_path: Path) -> None:
    path = tmp_path / "c.parquet"
    pq.write_table(pa.table({"text": ["a", None, "b", None]}), path)
    with pytest.raises(BadRecordsError, match=r"2 of 4 records are bad .*first at row 1: field"):
        read(path, ReaderSettings())


# --- code ---------------------------------------------------------------------------------


def test_code_files_are_one_document_each_with_their_language(tmp_path: Path) -> None:
    good = tmp_path / "m.py"
    good.write_text("def f():\n    return 1\n")
    docs, _ = read(good, ReaderSettings(), language="python")
    assert docs == [Document("def f():\n    return 1\n", str(good), 0, "code", "python")]

    empty, binary = tmp_path / "__init__.py", tmp_path / "blob.c"
    empty.write_text("  \n")
    binary.write_bytes(b"\x00\xff\xfe")
    # One file is one record: an empty __init__.py is counted, not fatal.
    stats = ReadStats()
    for path, language in ((empty, "python"), (binary, "c")):
        assert (
            list(read_source(SourceFile(str(path), "code", language), ReaderSettings(), stats))
            == []
        )
    assert stats.examples == [
        BadRecord(str(empty), 1, "empty file"),
        BadRecord(str(binary), 1, "not UTF-8"),
    ]


# --- the bad-record limit -----------------------------------------------------------------


def test_too_many_bad_records_stop_with_file_counts_and_first_line(tmp_path: Path) -> None:
    lines = [json.dumps({"text": f"doc {i}"}) for i in range(100)]
    for i in range(2, 98, 8):  # 12 bad lines, the first at line 3
        lines[i] = "{oops"
    path = tmp_path / "corpus.jsonl"
    path.write_text("\n".join(lines) + "\n")
    expected = (
        f"{path}: 12 of 100 records are bad (12.0%, above data.max_bad_fraction = 1.0%); "
        "first at line 3: invalid JSON"
    )
    with pytest.raises(BadRecordsError, match=re.escape(expected)):
        read(path, ReaderSettings())
    docs, stats = read(path, ReaderSettings(max_bad_fraction=0.12))  # at the limit passes
    assert len(docs) == 88 and stats.bad["invalid JSON"] == 12


def test_one_bad_record_in_a_hundred_is_within_the_default(tmp_path: Path) -> None:
    path = tmp_path / "c.txt"
    path.write_bytes(b"\n".join(b"line %d" % i for i in range(99)) + b"\n\xff\n")
    docs, stats = read(path, ReaderSettings(split="line"))
    assert len(docs) == 99 and stats.examples == [BadRecord(str(path), 100, "not UTF-8")]


def test_a_binary_file_is_not_scanned_to_the_end(tmp_path: Path) -> None:
    blob = random.Random(0).randbytes(20 << 20)
    for name, settings in (
        ("blob.jsonl", ReaderSettings()),
        ("blob.txt", ReaderSettings(split="line")),
    ):
        path = tmp_path / name
        path.write_bytes(blob)
        stats = ReadStats()
        source = SourceFile(str(path), "jsonl" if name.endswith("jsonl") else "text")
        with pytest.raises(BadRecordsError, match=r"stopped after 10\d\d records: \d+ of 10"):
            list(read_source(source, settings, stats))
        # About 80,000 lines were left unread (a short random line may decode, so not exactly).
        assert 1000 <= stats.records < 1010 and stats.documents < 5


def test_reader_settings_are_validated() -> None:
    with pytest.raises(ValueError, match=r"max_bad_fraction = 1\.5"):
        ReaderSettings(max_bad_fraction=1.5)
    with pytest.raises(ValueError, match="'paragraph' is not a split rule"):
        ReaderSettings(split="paragraph")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="text_field"):
        ReaderSettings(text_field="")
