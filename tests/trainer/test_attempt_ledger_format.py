"""Rank 0's attempt ledger as a typed format: a ledger written before it was typed (no version
field) still loads, and a ledger the clock writes now reads back as it was."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from infra.store.local import LocalStore
from infra.stored_format import StoredFormatError
from trainer.attempt_clock import AttemptClock, Ledger, ledger_key, read_ledger

# Generation 2 of a two-rank DDP run of the local stack, 400 steps, 20 commits, written by the
# code before the ledger was typed.
STORED = Path(__file__).parent / "stored" / "attempt-ledger-v1.json"


def test_a_ledger_written_before_the_type_loads_whole() -> None:
    raw = json.loads(STORED.read_text())
    ledger = Ledger.parse(STORED.read_bytes(), "runs/hc-bars/attempts/gen-2.json")
    assert (ledger.generation, ledger.ended, len(ledger.commits)) == (2, "done", 20)
    assert ledger.last is not None and ledger.last.totals.steps == 400
    assert ledger.dump() == {**raw, "version": 1}


def test_what_the_clock_writes_reads_back(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    clock = AttemptClock(store, "r", 3, resume_step=10, process_started_at=5.0, enabled=True)
    clock.ready(load_s=0.25)
    for step in (11, 12):
        clock.step_done(step, train_s=1.0, straggler_s=0.5)
    clock.save_issued(12)
    clock.committed(12)
    clock.end("done")
    ledger = read_ledger(store, "r", 3)
    assert ledger is not None and ledger.model_dump() == clock.ledger.model_dump()
    assert ledger.commits[0].totals.straggler_s == 1.0 and ledger.load_s == 0.25


def test_a_ledger_this_build_cannot_read_is_refused_by_key(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    key = ledger_key("r", 1)
    store.put_bytes(key, json.dumps({**json.loads(STORED.read_text()), "version": 7}).encode())
    with pytest.raises(StoredFormatError, match="attempt ledger of version 7"):
        read_ledger(store, "r", 1)
    assert read_ledger(store, "r", 2) is None  # no ledger: the ranks never reached a step
