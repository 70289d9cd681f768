"""A node that flaps for a long attempt keeps what it holds and what it signals bounded: the
progress tail keeps the newest health lines and a count, and the agent signals at most
HEALTH_SIGNALS of each kind to the run per attempt (each signal is an event in its history)."""

from __future__ import annotations

import json
from pathlib import Path

from activities.node import HEALTH_SIGNALS, _Reporter
from tests.activities.test_node_health_check import train_input
from trainer.progress_tail import HEALTH_KEPT, ProgressTail


def _append(path: Path, events: list[dict]) -> None:
    with open(path, "a") as out:
        for event in events:
            out.write(json.dumps({"time": 1.0e9, **event}) + "\n")


def _health(kind: str, step: int) -> dict:
    return {"event": "health", "kind": kind, "step": step, "node_index": 1, "evidence": "x"}


def test_a_flapping_node_keeps_and_signals_a_bounded_number_of_health_events(
    tmp_path: Path,
) -> None:
    progress = tmp_path / "progress.jsonl"
    tail = ProgressTail(progress)
    reporter = _Reporter("n1", train_input(), tmp_path, tell_cluster=False)
    signalled: list[dict] = []
    step = 0
    for _ in range(50):  # 50 polls, each finding a few new lines: 300 stragglers in all
        _append(progress, [_health("straggler", step := step + 1) for _ in range(6)])
        if step == 150:
            _append(progress, [_health("corruption", step)])
        tail.poll()
        signalled += reporter.new_health(dict(tail.latest))
    # Before: all 301 lines were kept in memory, returned in the attempt's result and
    # signalled to the run one by one.
    assert tail.latest["health_seen"] == 301
    assert len(tail.latest["health"]) == HEALTH_KEPT
    assert tail.latest["health"][-1]["step"] == 300  # the newest are the ones kept
    kinds = [e["kind"] for e in signalled]
    assert kinds.count("straggler") == HEALTH_SIGNALS
    assert kinds.count("corruption") == 1  # a rarer kind is not crowded out by a frequent one
    assert [e["step"] for e in signalled[:3]] == [1, 2, 3]  # in order, none twice


def test_a_peer_checkpoint_the_ranks_passed_over_is_kept_once_with_why(tmp_path: Path) -> None:
    progress = tmp_path / "progress.jsonl"
    tail = ProgressTail(progress)
    why = "peer checkpoint step 20 (generation 1) skipped: __1_0.distcp: n1 is not in this gang"
    _append(progress, [{"event": "peer_skipped", "why": why}] * 2)  # every rank says it
    _append(progress, [{"event": "peer_skipped", "why": "a later line"}])
    tail.poll()
    assert tail.latest["peer_skipped"] == why
