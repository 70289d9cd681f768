"""Readers turn source files into documents (plain strings), one rule per corpus layout."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

from dataprep.errors import SourceError

SplitRule = Literal["blank-line", "line", "whole-file"]

_BLANK_LINES = re.compile(r"\n\s*\n")


def check_sources(paths: list[Path]) -> None:
    """Fail before any work when a source is missing, so the error names it plainly."""
    for path in paths:
        if not path.is_file():
            raise SourceError(f"source {path} does not exist or is not a file: check data.sources")


def read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SourceError(f"source {path} does not exist: check data.sources") from None
    except UnicodeDecodeError as err:
        raise SourceError(
            f"source {path} is not UTF-8 text (byte {err.start} is invalid): "
            "convert it to UTF-8 or remove it from data.sources"
        ) from None
    except OSError as err:
        raise SourceError(f"source {path} cannot be read: {err.strerror}") from None


def split_documents(text: str, rule: SplitRule) -> Iterator[str]:
    """Cut text into documents; empty ones are dropped, surrounding whitespace is kept out."""
    if rule == "whole-file":
        pieces: list[str] = [text]
    elif rule == "line":
        pieces = text.splitlines()
    else:
        pieces = _BLANK_LINES.split(text)
    for piece in pieces:
        piece = piece.strip()
        if piece:
            yield piece


def read_documents(path: Path, rule: SplitRule) -> Iterator[str]:
    yield from split_documents(read_text(path), rule)
