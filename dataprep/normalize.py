"""The normalization that exact and near deduplication compare documents under."""

from __future__ import annotations

import re
import unicodedata

_SPACES = re.compile(r"\s+")


def normalize(text: str) -> str:
    """Fold case, Unicode forms and whitespace, so trivially reformatted copies compare equal."""
    return _SPACES.sub(" ", unicodedata.normalize("NFKC", text).casefold()).strip()
