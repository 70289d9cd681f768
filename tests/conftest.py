"""Shared fixtures: the repository's paths and a small corpus."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SHAKESPEARE = REPO / "examples" / "data" / "tinyshakespeare.txt"


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    """The first ~200 KB of tinyshakespeare plus two exact duplicates (one reformatted)."""
    text = SHAKESPEARE.read_text()[:200_000]
    speech = "First Citizen:\nBefore we proceed any further, hear me speak."
    path = tmp_path / "corpus.txt"
    reformatted = "  first citizen:\n  BEFORE we proceed any further,  hear me speak."
    path.write_text(f"{text}\n\n{speech}\n\n{reformatted}\n")
    return path
