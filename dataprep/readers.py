"""Readers turn source files into documents, one reader per format, counting what they skip.

A record that cannot become a document (bad bytes, bad JSON, a null cell) is skipped and counted
with its reason and line, because one damaged record should not sink a corpus; a file where too
many are damaged stops the read, because that file is probably not what its extension says.
"""

from __future__ import annotations

import gzip
import json
import os
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, get_args

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from dataprep import text_pieces as streamed
from dataprep.documents import BadRecord, Document, ReadStats
from dataprep.errors import BadRecordsError, SourceError
from dataprep.sources import SourceFile
from dataprep.text_pieces import (
    BOM,
    UNICODE_SPACES,
    SplitRule,
    source_errors,
    split_documents,
    text_pieces,
    whole_file,
)

# Part of this module's interface: the spec's split rule, the fuzz tests' spaces.
__all__ = ["UNICODE_SPACES", "ReaderSettings", "SplitRule", "read_source", "split_documents"]

# Below this many records a fraction says little, so a file is only stopped early after it.
EARLY_STOP_RECORDS = 1_000
MAX_CODE_FILE_BYTES = 64 << 20
_PARQUET_BATCH_ROWS = 1024
_PARQUET_BATCH_BYTES = 256 << 20  # of text, decompressed, in one batch


@dataclass(frozen=True)
class ReaderSettings:
    split: SplitRule = "blank-line"  # for text files
    text_field: str = "text"  # for JSONL and Parquet
    max_bad_fraction: float = 0.01  # above this, the read stops with an error

    def __post_init__(self) -> None:
        if self.split not in get_args(SplitRule):
            raise ValueError(
                f"split = {self.split!r} is not a split rule: use one of "
                f"{', '.join(get_args(SplitRule))}"
            )
        if not isinstance(self.text_field, str) or not self.text_field:
            raise ValueError("text_field must name the column or JSON field holding the text")
        if not 0.0 <= self.max_bad_fraction <= 1.0:
            raise ValueError(
                f"max_bad_fraction = {self.max_bad_fraction} must be within [0, 1] "
                "(0.01 allows 1% bad records per file)"
            )


def read_source(
    source: SourceFile, settings: ReaderSettings, stats: ReadStats
) -> Iterator[Document]:
    """Documents of one source file; bad records go to `stats` and, past the limit, raise."""
    tally = _Tally(source, settings.max_bad_fraction, stats)
    yield from _READERS[source.format](source, settings, tally)
    tally.finish()


class _Tally:
    """Counts one file's records, so the bad-record limit is judged per file, not per corpus."""

    def __init__(self, source: SourceFile, max_bad_fraction: float, stats: ReadStats) -> None:
        self.source = source
        self.max_bad_fraction = max_bad_fraction
        self.stats = stats
        self.records = 0
        self.bad_records = 0
        self.first_bad: BadRecord | None = None
        # A code file is one record, so any empty __init__.py would be "100% bad": the limit
        # only makes sense for files that hold many records.
        self.enforce = source.format != "code"

    def good(self) -> None:
        self.records += 1
        self.stats.add_document()

    def bad(self, line: int, reason: str) -> None:
        record = BadRecord(self.source.path, line, reason)
        self.records += 1
        self.bad_records += 1
        if self.first_bad is None:
            self.first_bad = record
        self.stats.add_bad(record)
        if (
            self.enforce
            and self.records >= EARLY_STOP_RECORDS
            and self.bad_records > 2 * self.max_bad_fraction * self.records
        ):
            raise self._error(early=True)

    def finish(self) -> None:
        if (
            self.enforce
            and self.bad_records
            and self.bad_records > self.max_bad_fraction * self.records
        ):
            raise self._error(early=False)

    def _error(self, early: bool) -> BadRecordsError:
        assert self.first_bad is not None
        unit = "row" if self.source.format == "parquet" else "line"
        stopped = f"stopped after {self.records} records: " if early else ""
        return BadRecordsError(
            f"{self.source.path}: {stopped}{self.bad_records} of {self.records} records are bad "
            f"({_percent(self.bad_records / self.records)}, above data.max_bad_fraction = "
            f"{_percent(self.max_bad_fraction)}); first at {unit} {self.first_bad.line}: "
            f"{self.first_bad.reason}. Fix or remove the file, or raise data.max_bad_fraction"
        )


def _percent(fraction: float) -> str:
    pct = 100 * fraction
    return f"{pct:.1f}%" if pct == 0 or pct >= 0.1 else f"{pct:.2g}%"


def _longer_than_the_cap(what: str) -> str:
    """Why a record was refused for its size: one cap (text_pieces.MAX_RECORD_BYTES) for every
    reader, so that no format lets through what another refuses."""
    cap = streamed.MAX_RECORD_BYTES
    return f"{what} longer than " + (f"{cap >> 20} MiB" if cap >= 1 << 20 else f"{cap} bytes")


def _read_bytes(path: str) -> bytes:
    with source_errors(path):
        return Path(path).read_bytes()


# --- plain text ---------------------------------------------------------------------------


def _read_text_file(
    source: SourceFile, settings: ReaderSettings, tally: _Tally
) -> Iterator[Document]:
    too_long = _longer_than_the_cap("document")
    if settings.split == "whole-file":
        pieces = whole_file(source.path)
    else:
        pieces = text_pieces(source.path, settings.split)
    # Each piece is decoded alone, so one bad byte costs one document, not the file.
    for index, (line, raw) in enumerate(pieces):
        if raw is None:
            tally.bad(line, too_long)
            continue
        try:
            text = raw.decode("utf-8").rstrip()
        except UnicodeDecodeError:
            tally.bad(line, "not UTF-8")
            continue
        tally.good()
        yield Document(text, source.path, index, "text")


# --- JSON lines ---------------------------------------------------------------------------

_GZIP_ERRORS = (EOFError, zlib.error, gzip.BadGzipFile)


def _read_jsonl(source: SourceFile, settings: ReaderSettings, tally: _Tally) -> Iterator[Document]:
    compressed = source.path.lower().endswith(".gz")
    field = settings.text_field
    # A plain file's OSError is a read failure, never a break in a compressed stream.
    broken_stream = _GZIP_ERRORS if compressed else ()
    line = 0
    try:
        stream: IO[bytes] = gzip.open(source.path, "rb") if compressed else open(source.path, "rb")  # noqa: SIM115
    except OSError as err:
        raise SourceError(f"source {source.path} cannot be read: {err.strerror}") from None
    with stream:
        try:
            while raw := stream.readline(streamed.MAX_RECORD_BYTES + 1):
                line += 1
                if len(raw) > streamed.MAX_RECORD_BYTES and not raw.endswith(b"\n"):
                    _skip_line(stream)
                    tally.bad(line, _longer_than_the_cap("record"))
                    continue
                if line == 1:
                    raw = raw.removeprefix(BOM)
                if not raw.strip():
                    continue  # blank lines are layout, not records
                text, reason = _json_text(raw, field)
                if text is None:
                    tally.bad(line, reason)
                    continue
                tally.good()
                yield Document(text, source.path, line, "text")
        except broken_stream as err:
            # Nothing after a break in the stream can be trusted; keep what came before it.
            reason = "truncated gzip" if isinstance(err, EOFError) else "corrupt gzip"
            tally.bad(line + 1, reason)
        except OSError as err:
            raise SourceError(f"source {source.path} cannot be read: {err.strerror}") from None


def _skip_line(stream: IO[bytes]) -> None:
    while (chunk := stream.readline(1 << 20)) and not chunk.endswith(b"\n"):
        pass


def _json_text(raw: bytes, field: str) -> tuple[str | None, str]:
    """The record's text, or None and why it is bad."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None, "not UTF-8"
    try:
        record = json.loads(line)
    except (ValueError, RecursionError):
        return None, "invalid JSON"
    if not isinstance(record, dict):
        return None, "not a JSON object"
    if field not in record:
        return None, f"missing field {field!r}"
    text = record[field]
    if not isinstance(text, str):
        return None, f"field {field!r} is not a string"
    if "\\u" in line:
        # JSON escapes can spell lone surrogates, which no tokenizer or file can hold.
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            return None, "not UTF-8"
    if not text.strip():
        return None, "empty text"
    return text, ""


# --- Parquet ------------------------------------------------------------------------------


def _is_text_type(kind: pa.DataType) -> bool:
    if pa.types.is_dictionary(kind):
        return _is_text_type(kind.value_type)
    return pa.types.is_string(kind) or pa.types.is_large_string(kind) or _is_string_view(kind)


def _is_string_view(kind: pa.DataType) -> bool:
    check = getattr(pa.types, "is_string_view", None)  # pyarrow >= 16
    return bool(check and check(kind))


# What a damaged Parquet file raises. UnicodeDecodeError: pyarrow decodes the footer's column
# names without checking them, so a flipped byte there escapes as that.
_PARQUET_ERRORS = (pa.ArrowException, OSError, UnicodeDecodeError)


def _read_parquet(
    source: SourceFile, settings: ReaderSettings, tally: _Tally
) -> Iterator[Document]:
    field = settings.text_field
    try:
        parquet = pq.ParquetFile(source.path)
        schema = parquet.schema_arrow
    except FileNotFoundError:
        raise SourceError(f"source {source.path} does not exist: check data.sources") from None
    except _PARQUET_ERRORS as err:
        raise SourceError(
            f"source {source.path} is not a readable Parquet file ({err}): "
            "fix it or remove it from data.sources"
        ) from None
    with parquet:
        if field not in schema.names:
            raise SourceError(
                f"source {source.path} has no column {field!r} (columns: "
                f"{', '.join(schema.names) or 'none'}): set data.text_field to the text column"
            )
        kind = schema.field(field).type
        if not _is_text_type(kind):
            raise SourceError(
                f"source {source.path}: column {field!r} has type {kind}, not string: "
                "set data.text_field to a string column"
            )
        row = 0
        # Batches of one column, sized by the widest row group's cells: a few compressed bytes
        # can hold megabytes of text, and a batch is decompressed whole.
        batch_rows = _batch_rows(parquet.metadata, field)
        batches = parquet.iter_batches(batch_size=batch_rows, columns=[field])
        while True:
            try:
                batch = next(batches, None)
            except _PARQUET_ERRORS as err:
                raise SourceError(
                    f"source {source.path} is damaged near row {row} ({err}): "
                    "fix it or remove it from data.sources"
                ) from None
            if batch is None:
                break
            column, oversized = _without_oversized_cells(batch.column(0))
            for text, too_big in zip(_cell_texts(column), oversized, strict=True):
                if too_big:
                    tally.bad(row, _longer_than_the_cap("document"))
                elif text is None:
                    tally.bad(row, f"field {field!r} is null")
                elif isinstance(text, bytes):
                    tally.bad(row, "not UTF-8")
                elif not text.strip():
                    tally.bad(row, "empty text")
                else:
                    tally.good()
                    yield Document(text, source.path, row, "text")
                row += 1


def _batch_rows(metadata: pq.FileMetaData, field: str) -> int:
    """Rows per batch: _PARQUET_BATCH_ROWS, fewer where the text column's decompressed bytes per
    row would make a batch pass _PARQUET_BATCH_BYTES. An estimate from the footer, which counts
    a dictionary-encoded column's repeated values once; each cell is capped all the same."""
    widest = 1.0
    for group in range(metadata.num_row_groups):
        row_group = metadata.row_group(group)
        for index in range(row_group.num_columns):
            chunk = row_group.column(index)
            if chunk.path_in_schema == field and row_group.num_rows:
                widest = max(widest, chunk.total_uncompressed_size / row_group.num_rows)
    return max(1, min(_PARQUET_BATCH_ROWS, int(_PARQUET_BATCH_BYTES // widest)))


def _without_oversized_cells(column: pa.Array) -> tuple[pa.Array, list[bool]]:
    """The column with cells over the record cap emptied (never turned into Python strings),
    and which ones they were."""
    if pa.types.is_dictionary(column.type):
        column = column.dictionary_decode()
    over = pc.fill_null(pc.greater(pc.binary_length(column), streamed.MAX_RECORD_BYTES), False)
    if not pc.any(over).as_py():
        return column, [False] * len(column)
    return pc.if_else(over, pa.scalar("", column.type), column), over.to_pylist()


def _cell_texts(column: pa.Array) -> list[str | bytes | None]:
    """The cells as text; a cell whose bytes are not UTF-8 as its bytes. Parquet writers are
    trusted to write UTF-8 into string columns and readers do not check: a damaged file's
    cell made pyarrow raise UnicodeDecodeError for the whole batch."""
    try:
        return column.to_pylist()
    except UnicodeDecodeError:
        pass
    if pa.types.is_dictionary(column.type):
        column = column.dictionary_decode()
    if pa.types.is_large_string(column.type):
        raw = column.cast(pa.large_binary())
    elif _is_string_view(column.type):
        raw = column.cast(pa.binary_view())
    else:
        raw = column.cast(pa.binary())
    return [_utf8_or_bytes(cell) for cell in raw.to_pylist()]


def _utf8_or_bytes(cell: bytes | None) -> str | bytes | None:
    if cell is None:
        return None
    try:
        return cell.decode("utf-8")
    except UnicodeDecodeError:
        return cell


# --- code ---------------------------------------------------------------------------------


def _read_code(source: SourceFile, settings: ReaderSettings, tally: _Tally) -> Iterator[Document]:
    try:
        size = os.stat(source.path).st_size
    except OSError as err:
        raise SourceError(f"source {source.path} cannot be read: {err.strerror}") from None
    if size > MAX_CODE_FILE_BYTES:
        tally.bad(1, f"file larger than {MAX_CODE_FILE_BYTES >> 20} MiB")
        return
    try:
        text = _read_bytes(source.path).removeprefix(BOM).decode("utf-8")
    except UnicodeDecodeError:
        tally.bad(1, "not UTF-8")
        return
    if not text.strip():
        tally.bad(1, "empty file")
        return
    tally.good()
    # Code keeps its whitespace: indentation is syntax.
    yield Document(text, source.path, 0, "code", source.language)


_Reader = Callable[[SourceFile, ReaderSettings, _Tally], Iterator[Document]]
_READERS: dict[str, _Reader] = {
    "text": _read_text_file,
    "jsonl": _read_jsonl,
    "parquet": _read_parquet,
    "code": _read_code,
}


# --- the original whole-file reader (snapshot.py) -----------------------------------------
