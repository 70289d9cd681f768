"""Plain text into document pieces, streamed: a line at a time, so memory holds one document
however large the file, and cut exactly where splitting the whole decoded text would cut.

The pieces stay bytes: the reader decodes each alone, so one bad byte costs one document.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO, AnyStr, Literal

from dataprep.errors import SourceError

SplitRule = Literal["blank-line", "line", "whole-file"]

# Larger records are skipped unread: a binary file without newlines must not become one
# line held whole in memory.
MAX_RECORD_BYTES = 64 << 20
BOM = b"\xef\xbb\xbf"

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


def spans(data: AnyStr, rule: SplitRule) -> Iterator[tuple[int, int, int]]:
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
    for _, start, end in spans(text, rule):
        yield text[start:end].rstrip()


@contextmanager
def source_errors(path: str) -> Iterator[None]:
    """OSErrors of reading a source as SourceErrors that name it (not retried: the file is
    missing or unreadable, and will stay so)."""
    try:
        yield
    except FileNotFoundError:
        raise SourceError(f"source {path} does not exist: check data.sources") from None
    except OSError as err:
        raise SourceError(f"source {path} cannot be read: {err.strerror}") from None


def _open(path: str) -> IO[bytes]:
    with source_errors(path):
        return open(path, "rb")  # the caller's `with` closes it


def whole_file(path: str) -> Iterator[tuple[int, bytes | None]]:
    with _open(path) as stream, source_errors(path):
        data = stream.read(len(BOM) + MAX_RECORD_BYTES + 1).removeprefix(BOM)
        if len(data) > MAX_RECORD_BYTES:  # the file is the document: not read further
            if not _blank_to_end(stream, data, line=False):
                first = _LEADING_SPACE[bytes].match(data).end()  # type: ignore[union-attr]
                yield 1 + data.count(b"\n", 0, first), None
            return
    for line, start, end in spans(data, "whole-file"):
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


def text_pieces(path: str, rule: SplitRule) -> Iterator[tuple[int, bytes | None]]:
    """(1-based line, bytes) of every non-blank piece of a text file, leading whitespace
    skipped, cut exactly where `spans` cuts the whole file; None for a piece longer than
    MAX_RECORD_BYTES, which is counted, not kept.

    The file is read a line at a time, so memory holds one document however large the file
    (a 10 GB file without a newline must not become one 10 GB line). For "blank-line", lines
    that are only whitespace end a document: exactly the separator `\\n\\s*\\n`.
    """
    leading = _LEADING_SPACE[bytes]
    parts: list[bytes] = []
    size, start, overlong = 0, 0, False  # start: the open piece's first line (0: none open)
    with _open(path) as stream, source_errors(path):
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
    if start:
        yield start, None if overlong else b"\n".join(parts)


def _lines(stream: IO[bytes]) -> Iterator[tuple[bytes | None, bool]]:
    """(line without its newline, whether it is blank); None for a line longer than
    MAX_RECORD_BYTES, which is skipped unkept."""
    if stream.peek(len(BOM)).startswith(BOM):  # type: ignore[attr-defined]
        stream.read(len(BOM))  # before the first line, so the BOM takes none of its length
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
