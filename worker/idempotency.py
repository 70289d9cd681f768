"""Idempotency keys of `POST /v1/runs`: a program that retries a submit after a timeout gets
the run it started, not a second one, and a key reused for another spec is caught.

One small file per (person, key) under the state folder's `api/idempotency/`, created with
O_EXCL: the first request to claim a key wins, whichever API process it reached. Keys are a
person's own, so two people cannot collide or probe each other's."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError

MAX_KEY_CHARS = 200


class KeyClaim(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    person: str
    key: str
    run: str
    spec_sha256: str


class IdempotencyKeys:
    def __init__(self, home: Path) -> None:
        self.folder = home / "api" / "idempotency"

    def claim(self, person: str, key: str, run: str, spec_sha256: str) -> KeyClaim:
        """The claim on `key`: this one when the key is new, else the one made first (the
        caller compares it with what it asked)."""
        mine = KeyClaim(person=person, key=key, run=run, spec_sha256=spec_sha256)
        name = hashlib.sha256(person.encode() + b"\0" + key.encode()).hexdigest()
        path = self.folder / f"{name}.json"
        self.folder.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            return _read(path)
        with os.fdopen(fd, "w") as out:
            out.write(mine.model_dump_json())
            out.flush()
            os.fsync(out.fileno())
        return mine


def _read(path: Path, wait_s: float = 2.0) -> KeyClaim:
    """A claim another request made; it may be between creating its file and writing it."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return KeyClaim.model_validate_json(path.read_bytes())
        except ValidationError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)
