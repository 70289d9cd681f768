"""The unit of data preparation: a document with where it came from."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Literal

DocumentKind = Literal["text", "code"]


@dataclass(frozen=True, slots=True)
class Document:
    text: str
    source: str  # the file it came from (as expanded from data.sources)
    # Where in that file: 0-based document index for plain text, 1-based line for JSONL,
    # 0-based row for Parquet, 0 for a code file (one document per file).
    position: int
    kind: DocumentKind = "text"
    language: str | None = None  # for code: the language its file extension names


@dataclass(frozen=True, slots=True)
class BadRecord:
    source: str
    line: int  # 1-based line (JSONL, text) or 0-based row (Parquet) where the record starts
    reason: str


@dataclass
class ReadStats:
    """What a reader saw: every record is either a document or a bad record with a reason."""

    records: int = 0
    documents: int = 0
    bad: Counter[str] = field(default_factory=Counter)
    examples: list[BadRecord] = field(default_factory=list)  # the first few, for reports

    MAX_EXAMPLES = 20

    def add_bad(self, record: BadRecord) -> None:
        self.records += 1
        self.bad[record.reason] += 1
        if len(self.examples) < self.MAX_EXAMPLES:
            self.examples.append(record)

    def add_document(self) -> None:
        self.records += 1
        self.documents += 1

    def merge(self, other: ReadStats) -> None:
        self.records += other.records
        self.documents += other.documents
        self.bad.update(other.bad)
        room = self.MAX_EXAMPLES - len(self.examples)
        self.examples.extend(other.examples[: max(0, room)])
