"""Rank logs shipped as append-only pieces: complete lines while running, the rest at the end,
nothing twice; a store that is away costs a round, not the attempt."""

from __future__ import annotations

import asyncio
from pathlib import Path

from infra.store.local import LocalStore
from trainer.rank_logs import LogShipper, pieces, shipped_while_running


def _text(store: LocalStore, run: str, name: str) -> str:
    return "".join(store.get_bytes(p.key).decode() for p in pieces(store, run) if p.name == name)


def test_complete_lines_ship_while_running_and_the_rest_at_the_end(tmp_path: Path) -> None:
    store, folder = LocalStore(tmp_path / "store"), tmp_path / "gen-3"
    folder.mkdir()
    (folder / "rank-1.log").write_text("step 5 loss 2.1\nstep 10 lo")
    (folder / "torchrun.log").write_text("started\n")
    (folder / "progress.jsonl").write_text("{}\n")  # not a log: never shipped
    shipper = LogShipper(store, "run", 3, "h2", folder)
    assert shipper.ship() == len("step 5 loss 2.1\n") + len("started\n")
    assert _text(store, "run", "rank-1") == "step 5 loss 2.1\n"
    assert shipper.ship() == 0  # nothing new: no empty pieces

    with open(folder / "rank-1.log", "a") as log:
        log.write("ss 2.0\nTraceback (most recent call last):")  # the rank died mid-line
    shipper.ship(final=True)
    assert _text(store, "run", "rank-1") == (folder / "rank-1.log").read_text()
    found = pieces(store, "run")
    assert {(p.generation, p.node_id, p.name) for p in found} == {
        (3, "h2", "rank-1"), (3, "h2", "torchrun")
    }  # fmt: skip
    assert [p.rank for p in found if p.name == "rank-1"] == [1, 1]  # two rounds, two pieces
    assert all(p.rank is None for p in found if p.name == "torchrun")


class _Away(LocalStore):
    """A store that fails its first puts, as one whose site is briefly unreachable."""

    failures = 2

    def put_bytes(self, key: str, data: bytes) -> None:
        if self.failures:
            self.failures -= 1
            raise ConnectionError("store away")
        super().put_bytes(key, data)


def test_a_store_that_is_away_gets_the_lines_on_a_later_round(tmp_path: Path) -> None:
    store, folder = _Away(tmp_path / "store"), tmp_path / "gen-1"
    folder.mkdir()
    shipper = LogShipper(store, "run", 1, "h1", folder)

    async def attempt() -> None:
        async with shipped_while_running(shipper, every_s=0.05):
            for index in range(10):
                with open(folder / "rank-0.log", "a") as log:
                    log.write(f"line {index}\n")
                await asyncio.sleep(0.03)

    asyncio.run(attempt())
    assert _text(store, "run", "rank-0") == "".join(f"line {i}\n" for i in range(10))
