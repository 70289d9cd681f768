"""Readers turn source files into documents, one reader per format, counting what they skip.

A record that cannot become a document (bad bytes, bad JSON, a null cell) is skipped and counted
with its reason and line, because one damaged record should not sink a corpus; a file where too
many are damaged stops the read, because that file is probably not what its extension says.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, AnyStr, Literal, get_args

import pyarrow as pa
import pyarrow.parquet as pq

from dataprep.documents import BadRecord, Document, ReadStats
from dataprep.errors import BadRecordsError, SourceError
from dataprep.sources import SourceFile

SplitRule = Literal["blank-line", "line", "whole-file"]

# Below this many records a fraction says little, so a file is only stopped early after it.
EARLY_STOP_RECORDS = 1_000
# Larger records are skipped unread: a binary file without newlines must not become one
# line held whole in memory.
MAX_RECORD_BYTES = 64 << 20
MAX_CODE_FILE_BYTES = 64 << 20
_PARQUET_BATCH_ROWS = 1024
_BOM = b"\xef\xbb\xbf"

# Every character for which str.isspace() is true, as UTF-8, so that splitting raw bytes (where
# a bad byte cannot stop us) cuts exactly where splitting the decoded text would.
UNICODE_SPACES = (
    "\t\n\x0b\x0c\r\x1c\x1d\x1e\x1f \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005"
    "\u2006\u2007\u2008\u2009\u200a\u2028\u2029\u202f\u205f\u3000"
)
_WS_BYTES = b"(?:" + b"|".join(re.escape(c.encode()) for c in UNICODE_SPACES) + b")"
_SEPARATORS: dict[tuple[type, str], re.Pattern] = {
    (str, "blank-line"): re.compile(r"\n\s*\n"),
    (bytes, "blank-line"): re.compile(b"\n" + _WS_BYTES + b"*\n"),
    (str, "line"): re.compile(r"\n"),
    (bytes, "line"): re.compile(rb"\n"),
}
_LEADING_SPACE: dict[type, re.Pattern] = {
    str: re.compile(r"\s*"),
    bytes: re.compile(_WS_BYTES + b"*"),
}


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


def _read_bytes(path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except FileNotFoundError:
        raise SourceError(f"source {path} does not exist: check data.sources") from None
    except OSError as err:
        raise SourceError(f"source {path} cannot be read: {err.strerror}") from None


# --- plain text ---------------------------------------------------------------------------


def _spans(data: AnyStr, rule: SplitRule) -> Iterator[tuple[int, int, int]]:
    """(1-based line, start, end) of every non-blank piece; start skips leading whitespace."""
    kind = type(data)
    leading = _LEADING_SPACE[kind]
    newline = "\n" if kind is str else b"\n"
    if rule == "whole-file":
        bounds: Iterator[tuple[int, int]] = iter([(0, len(data))])
    else:
        bounds = _between(_SEPARATORS[(kind, rule)], data)
    line, counted_to = 1, 0
    for start, end in bounds:
        first = leading.match(data, start, end).end()  # type: ignore[union-attr]
        if first == end:
            continue  # only whitespace: not a document
        line += data.count(newline, counted_to, first)  # type: ignore[arg-type]
        counted_to = first
        yield line, first, end


def _between(separator: re.Pattern, data: AnyStr) -> Iterator[tuple[int, int]]:
    start = 0
    for match in separator.finditer(data):
        yield start, match.start()
        start = match.end()
    yield start, len(data)


def split_documents(text: str, rule: SplitRule) -> Iterator[str]:
    """Cut text into documents; empty ones are dropped, surrounding whitespace is kept out."""
    for _, start, end in _spans(text, rule):
        yield text[start:end].rstrip()


def _read_text_file(
    source: SourceFile, settings: ReaderSettings, tally: _Tally
) -> Iterator[Document]:
    too_long = f"document longer than {MAX_RECORD_BYTES >> 20} MiB"
    if settings.split == "whole-file":
        pieces = _whole_file(source.path)
    else:
        pieces = _text_pieces(source.path, settings.split)
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


def _open(path: str) -> IO[bytes]:
    try:
        return open(path, "rb")  # the caller's `with` closes it
    except FileNotFoundError:
        raise SourceError(f"source {path} does not exist: check data.sources") from None
    except OSError as err:
        raise SourceError(f"source {path} cannot be read: {err.strerror}") from None


def _whole_file(path: str) -> Iterator[tuple[int, bytes | None]]:
    with _open(path) as stream:
        try:
            data = stream.read(len(_BOM) + MAX_RECORD_BYTES + 1).removeprefix(_BOM)
            if len(data) > MAX_RECORD_BYTES:  # the file is the document: not read further
                if not _blank_to_end(stream, data, line=False):
                    first = _LEADING_SPACE[bytes].match(data).end()  # type: ignore[union-attr]
                    yield 1 + data.count(b"\n", 0, first), None
                return
        except OSError as err:
            raise SourceError(f"source {path} cannot be read: {err.strerror}") from None
    for line, start, end in _spans(data, "whole-file"):
        yield line, data[start:end]


# bytes.strip's share of str.isspace(): the rest of UNICODE_SPACES is not ASCII.
_ASCII_SPACES = b" \t\n\r\x0b\x0c\x1c\x1d\x1e\x1f"
_ONLY_SPACES = re.compile(_WS_BYTES + b"*")


def _is_blank(line: bytes) -> bool:
    """Whether `line` is only whitespace, as str.isspace() would say."""
    rest = line.strip(_ASCII_SPACES)
    if not rest:
        return True
    if rest[0] < 0x80:  # a character that is not a space: most lines end here
        return False
    return _ONLY_SPACES.fullmatch(rest) is not None


def _text_pieces(path: str, rule: SplitRule) -> Iterator[tuple[int, bytes | None]]:
    """(1-based line, bytes) of every non-blank piece of a text file, leading whitespace
    skipped, cut exactly where `_spans` cuts the whole file; None for a piece longer than
    MAX_RECORD_BYTES, which is counted, not kept.

    The file is read a line at a time, so memory holds one document however large the file
    (a 10 GB file without a newline must not become one 10 GB line). For "blank-line", lines
    that are only whitespace end a document: exactly the separator `\\n\\s*\\n`.
    """
    leading = _LEADING_SPACE[bytes]
    parts: list[bytes] = []
    size, start, overlong = 0, 0, False  # start: the open piece's first line (0: none open)
    with _open(path) as stream:
        try:
            for number, (body, blank) in enumerate(_lines(stream), 1):
                if blank:
                    if start:
                        yield start, None if overlong else b"\n".join(parts)
                        parts, size, start, overlong = [], 0, 0, False
                    continue
                if body is not None and not start:
                    body = body[leading.match(body).end() :]  # type: ignore[union-attr]
                if rule == "line":
                    yield number, body
                    continue
                start = start or number
                if overlong:
                    continue
                size += len(body) + 1 if body is not None else 0  # + 1: its newline
                if body is None or size > MAX_RECORD_BYTES + 1:
                    parts, overlong = [], True  # the rest of it is skipped unkept
                else:
                    parts.append(body)
        except OSError as err:
            raise SourceError(f"source {path} cannot be read: {err.strerror}") from None
    if start:
        yield start, None if overlong else b"\n".join(parts)


def _lines(stream: IO[bytes]) -> Iterator[tuple[bytes | None, bool]]:
    """(line without its newline, whether it is blank); None for a line longer than
    MAX_RECORD_BYTES, which is skipped unkept."""
    if stream.peek(len(_BOM)).startswith(_BOM):  # type: ignore[attr-defined]
        stream.read(len(_BOM))  # before the first line, so the BOM takes none of its length
    while raw := stream.readline(MAX_RECORD_BYTES + 1):
        if raw.endswith(b"\n"):
            yield raw[:-1], _is_blank(raw[:-1])
        elif len(raw) <= MAX_RECORD_BYTES:  # the last line, without a newline
            yield raw, _is_blank(raw)
        else:
            yield None, _blank_to_end(stream, raw, line=True)


def _blank_to_end(stream: IO[bytes], head: bytes, line: bool) -> bool:
    """Read on to the end of the line (or of the file) that began with `head`, keeping none
    of it; whether all of it was whitespace (a blank line still separates documents)."""
    pending, blank = head, True
    while True:
        # A multi-byte space cut at the chunk's end is judged with the next chunk.
        cut = _complete_utf8(pending)
        blank = blank and _is_blank(pending[:cut])
        pending = pending[cut:]
        chunk = stream.readline(1 << 20) if line else stream.read(1 << 20)
        ended = line and chunk.endswith(b"\n")
        pending += chunk[:-1] if ended else chunk
        if ended or not chunk:
            return blank and _is_blank(pending)


def _complete_utf8(data: bytes) -> int:
    """Where a UTF-8 sequence cut short at the end of `data` starts; len(data) if none is."""
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte < 0x80:
            return len(data)
        if byte >= 0xC0:  # the lead byte: how long its sequence should be
            length = 2 if byte < 0xE0 else 3 if byte < 0xF0 else 4
            return len(data) - back if back < length else len(data)
    return len(data)


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
            while raw := stream.readline(MAX_RECORD_BYTES + 1):
                line += 1
                if len(raw) > MAX_RECORD_BYTES and not raw.endswith(b"\n"):
                    _skip_line(stream)
                    tally.bad(line, f"record longer than {MAX_RECORD_BYTES >> 20} MiB")
                    continue
                if line == 1:
                    raw = raw.removeprefix(_BOM)
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
        # Batches of one column keep memory at a row group's worth, whatever the file size.
        batches = parquet.iter_batches(batch_size=_PARQUET_BATCH_ROWS, columns=[field])
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
            for text in _cell_texts(batch.column(0)):
                if text is None:
                    tally.bad(row, f"field {field!r} is null")
                elif isinstance(text, bytes):
                    tally.bad(row, "not UTF-8")
                elif not text.strip():
                    tally.bad(row, "empty text")
                else:
                    tally.good()
                    yield Document(text, source.path, row, "text")
                row += 1


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
        text = _read_bytes(source.path).removeprefix(_BOM).decode("utf-8")
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
