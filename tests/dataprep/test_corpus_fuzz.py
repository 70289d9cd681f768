"""Bad corpora, fuzzed: empty, binary, not UTF-8, enormous lines, truncated or corrupt gzip and
Parquet, folders that name nothing. Each is read (bad records counted with their reason) or
stopped with a DataprepError naming the file; never a raw decoding, zlib or OS error. A corpus
that is refused leaves every snapshot already in the store as it was."""

from __future__ import annotations

import gzip
import io
import json
import os
import tracemalloc
from pathlib import Path
from unittest import mock

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import event, example, given
from hypothesis import strategies as st

from dataprep import plan as plan_module
from dataprep import text_pieces
from dataprep.documents import Document, ReadStats
from dataprep.errors import DataprepError, SourceError
from dataprep.filters import FilterSettings
from dataprep.readers import ReaderSettings, SplitRule, read_source
from dataprep.settings import SnapshotSettings
from dataprep.snapshot import prepare_snapshot
from dataprep.sources import classify, expand_sources
from infra.store.local import LocalStore
from tests.fuzz_strategies import fuzz

LENIENT = ReaderSettings(max_bad_fraction=1.0)
RULES: list[SplitRule] = ["blank-line", "line", "whole-file"]
BOM = b"\xef\xbb\xbf"
# Pieces of text that stress the splitting: every kind of space, bad bytes, multi-byte
# characters (also cut in half), separators, a BOM.
TEXT_PIECES = [b"a", b"bc", b" ", b"\t", b"\r", b"\n", b"\n\n", b"\n \n", b"\x0b", b"\x1c",
               b"\xc2\x85", b"\xc2\xa0", "\u2003".encode(), "\u3000".encode(),
               "\u2028".encode(), b"\xff", b"\xc2", b"\xe2\x80", "é".encode(), "語".encode(), BOM,
               b"\x00"]  # fmt: skip


def text_bytes() -> st.SearchStrategy[bytes]:
    return st.lists(st.sampled_from(TEXT_PIECES), max_size=60).map(b"".join)


def jsonl_bytes() -> st.SearchStrategy[bytes]:
    record = st.one_of(
        st.builds(lambda t: json.dumps({"text": t}).encode(), st.text(max_size=30)),
        st.builds(lambda v: json.dumps({"text": v}).encode(), st.integers() | st.none()),
        st.sampled_from([b"{", b"[]", b"null", b'{"txt": "a"}', b'{"text": "\\ud800"}', b"\xff"]),
        st.binary(max_size=20),
    )
    return st.lists(record, max_size=20).map(b"\n".join)


def corpus_bytes() -> st.SearchStrategy[bytes]:
    return st.one_of(st.binary(max_size=3000), text_bytes(), jsonl_bytes())


def read(path: Path, settings: ReaderSettings = LENIENT) -> tuple[list[Document], ReadStats]:
    source = classify(str(path))
    assert source is not None, path
    stats = ReadStats()
    return list(read_source(source, settings, stats)), stats


def read_or_refuse(path: Path, settings: ReaderSettings) -> list[Document] | None:
    """The documents, or None when the reader refused the file with its name and the reason."""
    try:
        docs, stats = read(path, settings)
    except DataprepError as err:
        event(f"refused: {type(err).__name__}")
        assert str(path) in str(err), str(err)
        return None
    event("read" if docs else "read, no documents")
    assert stats.records == stats.documents + sum(stats.bad.values())
    for doc in docs:
        assert doc.text.strip() and doc.source == str(path)
        doc.text.encode("utf-8")  # no lone surrogates: tokenizers and Parquet need UTF-8
    return docs


def _parquet(texts: list[str | None]) -> bytes:
    sink = io.BytesIO()
    pq.write_table(pa.table({"text": pa.array(texts, pa.string())}), sink, row_group_size=7)
    return sink.getvalue()


GOOD_PARQUET = _parquet([f"row {i} text" if i % 5 else None for i in range(40)])
GOOD_GZIP = gzip.compress(
    b"".join(json.dumps({"text": f"doc {i}"}).encode() + b"\n" for i in range(200))
)


@fuzz(300)
@given(
    st.sampled_from(["c.txt", "c.md", "c.jsonl", "c.json", "c.jsonl.gz", "c.parquet", "c.py"]),
    corpus_bytes(),
    st.sampled_from(RULES),
    st.sampled_from([0.0, 0.01, 0.5, 1.0]),
)
@example("c.txt", b"", "blank-line", 0.01)
@example("c.parquet", b"", "blank-line", 0.01)
@example("c.jsonl.gz", b"\x1f\x8b", "blank-line", 0.01)
def test_any_bytes_in_any_format_are_read_or_refused_by_name(
    tmp_path: Path, name: str, data: bytes, split: SplitRule, max_bad: float
) -> None:
    path = tmp_path / name
    path.write_bytes(data)
    read_or_refuse(path, ReaderSettings(split=split, max_bad_fraction=max_bad))


@fuzz(150)
@given(st.sampled_from(["gzip", "parquet"]), st.data())
def test_truncated_or_damaged_compressed_files_keep_only_what_is_sound(
    tmp_path: Path, kind: str, data: st.DataObject
) -> None:
    good = GOOD_GZIP if kind == "gzip" else GOOD_PARQUET
    path = tmp_path / ("c.jsonl.gz" if kind == "gzip" else "c.parquet")
    path.write_bytes(good)
    whole = [d.text for d in read(path)[0]]
    damaged = bytearray(good)
    if data.draw(st.booleans(), label="truncate"):
        del damaged[data.draw(st.integers(0, len(good) - 1), label="cut") :]
    else:
        for _ in range(data.draw(st.integers(1, 3), label="flips")):
            damaged[data.draw(st.integers(0, len(good) - 1), label="at")] = data.draw(
                st.integers(0, 255), label="byte"
            )
    path.write_bytes(bytes(damaged))
    docs = read_or_refuse(path, LENIENT)
    if docs is not None and kind == "gzip" and len(damaged) < len(good):
        # A cut stream yields a prefix of the documents: nothing is invented.
        assert [d.text for d in docs] == whole[: len(docs)]


@fuzz(100)
@given(st.binary(min_size=0, max_size=4000), st.sampled_from([0.01, 1.0]))
def test_gzip_of_binary_is_counted_bad_or_refused(
    tmp_path: Path, payload: bytes, max_bad: float
) -> None:
    path = tmp_path / "c.jsonl.gz"
    path.write_bytes(gzip.compress(payload))
    read_or_refuse(path, ReaderSettings(max_bad_fraction=max_bad))


def _oracle(data: bytes, rule: SplitRule) -> list[tuple[int, bytes, int]]:
    """(line, piece, bytes from its line's start) as splitting the whole file in memory cuts it
    (the reader before it streamed)."""
    body = data.removeprefix(BOM)
    return [
        (line, body[start:end], end - (body.rfind(b"\n", 0, start) + 1))
        for line, start, end in text_pieces.spans(body, rule)
    ]


def _text(raw: bytes) -> str | None:
    try:
        return raw.decode("utf-8").rstrip()
    except UnicodeDecodeError:
        return None


@fuzz(300)
@given(
    st.one_of(text_bytes(), st.builds(lambda b: BOM + b, text_bytes())),
    st.sampled_from(RULES),
    st.sampled_from([None, 3, 8, 20]),
)
@example(b"a\n\xc2\x85\xc2\x85\xc2\x85\nb", "blank-line", 3)  # a long blank line, cut mid-space
def test_streamed_text_cuts_where_the_whole_file_split_does(
    tmp_path: Path, data: bytes, rule: SplitRule, limit: int | None
) -> None:
    """The text reader reads a line at a time; it must cut, number and decode every document
    exactly as splitting the whole file did, and skip (only) documents over the size limit."""
    path = tmp_path / "c.txt"
    path.write_bytes(data)
    limit = limit or text_pieces.MAX_RECORD_BYTES
    with mock.patch.object(text_pieces, "MAX_RECORD_BYTES", limit):
        pieces = list(text_pieces.whole_file(str(path)) if rule == "whole-file" else
                      text_pieces.text_pieces(str(path), rule))  # fmt: skip
    expected = _oracle(data, rule)
    assert len(pieces) == len(expected), (pieces, expected)
    for (line, raw), (want_line, want, extent) in zip(pieces, expected, strict=True):
        if raw is None and rule == "whole-file":  # the file is the document, from byte 0
            assert len(data.removeprefix(BOM)) > limit
            continue
        assert line == want_line
        if raw is None:
            event("a document over the limit")
            assert extent > limit
        else:
            assert len(raw) <= limit and _text(raw) == _text(want)
    if limit == text_pieces.MAX_RECORD_BYTES:
        docs, _ = read(path, ReaderSettings(split=rule, max_bad_fraction=1.0))
        assert [d.text for d in docs] == [t for _, w, _ in expected if (t := _text(w))]


# --- enormous lines --------------------------------------------------------------------------

BIG = 50 << 20  # 50 MiB


def _one_line_file(path: Path, size: int, unit: bytes = b"word ") -> Path:
    with path.open("wb") as out:
        block = unit * ((1 << 20) // len(unit))
        for _ in range(size // len(block)):
            out.write(block)
    return path


def _peak_allocated(read_it) -> tuple[object, int]:
    tracemalloc.start()
    try:
        result = read_it()
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_50_mib_line_is_one_document(tmp_path: Path) -> None:
    path = _one_line_file(tmp_path / "big.txt", BIG)
    size = path.stat().st_size
    assert size > BIG - (1 << 20)
    docs, stats = read(path, ReaderSettings(split="line"))
    assert len(docs) == 1 and len(docs[0].text) == size - 1  # the last space is stripped
    assert stats.bad == {}


def test_a_line_over_the_limit_is_skipped_without_holding_it(tmp_path: Path) -> None:
    """Memory stays at the limit, not at the line: a 50 MiB line under a 1 MiB limit."""
    path = _one_line_file(tmp_path / "big.txt", BIG)
    (tmp_path / "small.txt").write_bytes(b"x" * 100)
    with mock.patch.object(text_pieces, "MAX_RECORD_BYTES", 1 << 20):
        for rule in RULES:
            (docs, stats), peak = _peak_allocated(
                lambda rule=rule: read(path, ReaderSettings(split=rule, max_bad_fraction=1.0))
            )
            assert docs == [] and stats.bad == {"document longer than 1 MiB": 1}, rule
            assert peak < 8 << 20, (rule, peak)
        with pytest.raises(DataprepError, match=r"big\.txt: 1 of 1 records are bad .* longer"):
            read(path, ReaderSettings())


def test_a_50_mib_jsonl_line_is_one_record(tmp_path: Path) -> None:
    path = tmp_path / "big.jsonl"
    text = "word " * (BIG // 5)
    path.write_text(json.dumps({"text": text}) + "\n" + json.dumps({"text": "small"}) + "\n")
    docs, _ = read(path)
    assert [len(d.text) for d in docs] == [len(text), 5]
    path.write_bytes(b"\xff" * BIG)
    with pytest.raises(DataprepError, match=r"big\.jsonl: 1 of 1 records are bad .*not UTF-8"):
        read(path, ReaderSettings())


# --- sources that name nothing ---------------------------------------------------------------


def _loop(folder: Path) -> Path:
    folder.mkdir()
    (folder / "real.txt").write_text("a real document\n")
    os.symlink(folder / "l2.txt", folder / "l1.txt")
    os.symlink(folder / "l1.txt", folder / "l2.txt")
    os.symlink(folder, folder / "self")  # a folder link back up: not followed
    return folder


@pytest.mark.parametrize(
    ("make", "pattern", "found"),
    [
        (lambda d: (d / "empty").mkdir(), "empty", r"source pattern .*empty matches no files"),
        (lambda d: None, "missing", r"source .*missing does not exist"),
        (lambda d: None, "missing/*.txt", r"matches no files"),
        (lambda d: (d / "x.bin").write_bytes(b"x"), "x.bin", r"x\.bin has an unknown extension"),
        (lambda d: _loop(d / "loop"), "loop/l1.txt", r"l1\.txt is a symbolic link to nothing"),
        (lambda d: _loop(d / "loop"), "loop", ["real.txt"]),
        (lambda d: _loop(d / "loop"), "loop/*.txt", ["real.txt"]),
        (lambda d: _loop(d / "loop"), "loop/**", ["real.txt"]),
    ],
)
def test_sources_that_name_nothing_are_named(
    tmp_path: Path, make, pattern: str, found: str | list[str]
) -> None:
    make(tmp_path)
    if isinstance(found, list):
        assert [Path(s.path).name for s in expand_sources([str(tmp_path / pattern)])] == found
    else:
        with pytest.raises(SourceError, match=found):
            expand_sources([str(tmp_path / pattern)])


def test_a_source_that_cannot_be_hashed_is_a_source_error(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("text\n")

    def unreadable(path: Path) -> str:
        raise PermissionError(13, "Permission denied", str(path))

    with (
        mock.patch.object(plan_module, "sha256_file", unreadable),
        pytest.raises(SourceError, match=r"a\.txt cannot be read \(Permission denied\)"),
    ):
        plan_module.plan_snapshot([str(tmp_path / "a.txt")], SnapshotSettings())


# --- nothing stored is lost --------------------------------------------------------------------


def _contents(store: LocalStore) -> dict[str, bytes]:
    return {key: store.get_bytes(key) for key in store.list("")}


def test_a_refused_corpus_leaves_the_stored_snapshot_untouched(
    corpus: Path, tmp_path: Path
) -> None:
    store = LocalStore(tmp_path / "store")
    settings = SnapshotSettings(filters=FilterSettings(min_words=1), shard_tokens=20_000)
    first = prepare_snapshot([str(corpus)], settings, store, tmp_path / "work")
    before = _contents(store)
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b"\xff\xfe not json\n" * 50)
    gz = tmp_path / "cut.jsonl.gz"
    gz.write_bytes(GOOD_GZIP[:40])
    for sources in ([corpus, bad], [bad], [gz], [corpus, tmp_path / "missing.txt"]):
        with pytest.raises(DataprepError):
            prepare_snapshot([str(s) for s in sources], settings, store, tmp_path / "work")
    after = _contents(store)
    # Every object of the committed snapshot is byte for byte what it was; a refused corpus
    # may leave only its own plan and work files, under its own snapshot id.
    assert {k: after[k] for k in before} == before
    assert all(
        k.startswith("datasets/") and first.snapshot_id not in k
        for k in after.keys() - before.keys()
    )
    again = prepare_snapshot([str(corpus)], settings, store, tmp_path / "work")
    assert again.reused and again.manifest_sha256 == first.manifest_sha256
