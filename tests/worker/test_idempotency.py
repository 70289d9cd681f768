"""Idempotency keys (worker/idempotency.py): a claim that finds another being written waits
without holding the event loop, and a key older than a day is forgotten, its file removed."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

from worker.idempotency import KEY_TTL_S, IdempotencyKeys, KeyClaim


def test_a_claim_waits_for_one_being_written_without_holding_the_loop(tmp_path: Path) -> None:
    keys = IdempotencyKeys(tmp_path)
    first = KeyClaim(person="alice", key="k", run="a", spec_sha256="0" * 64)
    path = keys.path("alice", "k")
    path.parent.mkdir(parents=True)
    path.touch()  # another request created the key's file and has not written it yet

    async def main() -> tuple[int, KeyClaim]:
        claim = asyncio.create_task(keys.claim("alice", "k", "b", "1" * 64))
        ticks = 0
        for _ in range(10):  # the loop goes on while the claim waits
            await asyncio.sleep(0.01)
            ticks += 1
        assert not claim.done()
        path.write_text(first.model_dump_json())
        return ticks, await claim

    started = time.monotonic()
    ticks, claim = asyncio.run(main())
    assert (ticks, claim) == (10, first) and time.monotonic() - started < 1.5


def test_keys_older_than_a_day_are_forgotten(tmp_path: Path) -> None:
    keys = IdempotencyKeys(tmp_path)
    asyncio.run(keys.claim("alice", "old", "run-a", "0" * 64))
    asyncio.run(keys.claim("alice", "new", "run-b", "0" * 64))
    day_ago = time.time() - KEY_TTL_S - 60
    os.utime(keys.path("alice", "old"), (day_ago, day_ago))

    # A later process's first claim sweeps: the old key's file goes, the new one's stays.
    later = IdempotencyKeys(tmp_path)
    assert asyncio.run(later.claim("alice", "old", "run-c", "1" * 64)).run == "run-c"
    assert asyncio.run(later.claim("alice", "new", "run-d", "1" * 64)).run == "run-b"
    assert len(list(later.folder.iterdir())) == 2
    os.utime(keys.path("alice", "new"), (day_ago, day_ago))
    assert later.remove_expired() == 1 and not keys.path("alice", "new").exists()
