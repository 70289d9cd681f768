"""Typed records kept in the store: parsed once where they are read, dumped once where they
are written, so no reader indexes a dict by string keys.

A stored record outlives the code that wrote it: a checkpoint from last month is resumed by
today's build, and a newer build's record may meet an older reader. So every format names its
version in one field, and `parse` refuses a version it does not know, or a field that is missing
or of the wrong type, with the store key that holds the record and the field, instead of a
KeyError three calls later. Fields added later have defaults, so records written before them
still load. Unknown fields are kept (`extra="allow"`): a newer writer's additions survive a
read and a rewrite by an older build.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, ClassVar, Self

from pydantic import BaseModel, ConfigDict, ValidationError

from infra.errors import IntegrityError


class StoredFormatError(IntegrityError):
    """A stored record that this build cannot read: a version it does not know, or a field that
    is missing or malformed. Readers that pass over corrupt records pass over these too."""


class StoredRecord(BaseModel):
    """Base of every typed stored record. A subclass names its version field (`VERSION_FIELD`)
    and the versions it reads (`VERSIONS`); the first of them is the one it writes."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    VERSION_FIELD: ClassVar[str] = "format"
    VERSIONS: ClassVar[tuple[Any, ...]] = ()
    # What one record is, for messages ("checkpoint manifest").
    WHAT: ClassVar[str] = "record"

    @classmethod
    def parse(cls, raw: bytes | str | Mapping[str, Any], key: str) -> Self:
        """The record stored at `key`, checked: StoredFormatError names the key and the field."""
        try:
            data = json.loads(raw) if isinstance(raw, bytes | str) else dict(raw)
        except ValueError as err:
            why = f"not JSON ({err})"
            raise StoredFormatError(f"{key} is not a readable {cls.WHAT}: {why}") from None
        if not isinstance(data, dict):
            raise StoredFormatError(f"{key} is not a readable {cls.WHAT}: not a JSON object")
        version = data.get(cls.VERSION_FIELD, cls._unversioned())
        if version not in cls.VERSIONS:
            known = ", ".join(str(v) for v in cls.VERSIONS)
            raise StoredFormatError(
                f"{key}: {cls.WHAT} of {cls.VERSION_FIELD} {version!r}, which this build does "
                f"not read (it reads {known}); read it with the Forgeline release that wrote it, "
                "or upgrade this one"
            )
        try:
            return cls.model_validate(data)
        except ValidationError as err:
            problems = "; ".join(
                f"field {'.'.join(str(p) for p in e['loc'])!r}: {e['msg'].lower()}"
                for e in err.errors()
            )
            raise StoredFormatError(f"{key}: not a valid {cls.WHAT} ({problems})") from None

    @classmethod
    def _unversioned(cls) -> Any:
        """The version of a record written before the format named one (None: there was none)."""
        return None

    def dump(self) -> dict[str, Any]:
        """The record as stored, fields by their stored names. (Python mode, not JSON mode: a
        loss history may hold NaN, which JSON mode would write as null.)"""
        return self.model_dump(by_alias=True)

    def dump_bytes(self) -> bytes:
        return json.dumps(self.dump(), indent=2, sort_keys=True).encode()


class StoredFile(BaseModel):
    """A file in the store that a record names: its key, size and sha256 (what readers verify
    before they use it)."""

    model_config = ConfigDict(extra="allow", frozen=True)

    key: str
    bytes: int
    sha256: str
