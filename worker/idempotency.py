"""Idempotency keys of `POST /v1/runs`: a program that retries a submit after a timeout gets
the run it started, not a second one, and a key reused for another spec is caught.

One small file per (person, key) under the state folder's `api/idempotency/`, created with
O_EXCL: the first request to claim a key wins, whichever API process it reached. Keys are a
person's own, so two people cannot collide or probe each other's.

A key is remembered for `KEY_TTL_S` (a day, as long as any retry waits), then forgotten: claims
older than that are removed at claim time, by one sweep of the folder every `SWEEP_EVERY_S` at
most, so the folder holds about a day of keys. A retry after that still finds its run by name.
Claims are made and read in threads, and a claim that finds one being written waits for it with
asyncio's sleep: the event loop that answers every other request is never held.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import time
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError

MAX_KEY_CHARS = 200
KEY_TTL_S = 24 * 3600
SWEEP_EVERY_S = 600


class KeyClaim(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    person: str
    key: str
    run: str
    spec_sha256: str


class IdempotencyKeys:
    def __init__(self, home: Path, ttl_s: float = KEY_TTL_S) -> None:
        self.folder = home / "api" / "idempotency"
        self.ttl_s = ttl_s
        self._next_sweep = 0.0  # time.monotonic(): the first claim sweeps

    def path(self, person: str, key: str) -> Path:
        name = hashlib.sha256(person.encode() + b"\0" + key.encode()).hexdigest()
        return self.folder / f"{name}.json"

    async def claim(self, person: str, key: str, run: str, spec_sha256: str) -> KeyClaim:
        """The claim on `key`: this one when the key is new (or forgotten), else the one made
        first (the caller compares it with what it asked)."""
        mine = KeyClaim(person=person, key=key, run=run, spec_sha256=spec_sha256)
        if time.monotonic() >= self._next_sweep:
            self._next_sweep = time.monotonic() + SWEEP_EVERY_S
            await asyncio.to_thread(self.remove_expired)
        path = self.path(person, key)
        while True:
            if await asyncio.to_thread(_create, path, mine):
                return mine
            with contextlib.suppress(FileNotFoundError):  # swept between the two: claim it
                return await _read(path)

    def remove_expired(self) -> int:
        """Remove the claims older than the TTL; how many were."""
        cutoff = time.time() - self.ttl_s
        removed = 0
        with contextlib.suppress(FileNotFoundError), os.scandir(self.folder) as entries:
            for entry in entries:
                with contextlib.suppress(FileNotFoundError):  # another process swept it
                    if entry.name.endswith(".json") and entry.stat().st_mtime < cutoff:
                        os.unlink(entry.path)
                        removed += 1
        return removed


def _create(path: Path, claim: KeyClaim) -> bool:
    """Whether this claim was written: False when the key's file exists."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as out:
        out.write(claim.model_dump_json())
        out.flush()
        os.fsync(out.fileno())
    return True


async def _read(path: Path, wait_s: float = 2.0) -> KeyClaim:
    """A claim another request made; it may be between creating its file and writing it."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return KeyClaim.model_validate_json(await asyncio.to_thread(path.read_bytes))
        except ValidationError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.01)
