"""The agent's other readers of the ranks' progress file are bounded too: the metric tap that
spools step and eval lines for MLflow reads at most 1 MiB a poll and passes over a line too long
or odd, and no line a script writes can fail the agent's heartbeat (trainer/rank_lines.py)."""

from __future__ import annotations

import json
from pathlib import Path

from temporalio.testing import ActivityEnvironment

from activities.metric_tap import MetricTap
from activities.node import _Reporter
from registry.metric_stream import MetricSpool
from tests.activities.test_node_health_check import train_input
from trainer.progress_tail import ProgressTail
from trainer.rank_lines import MAX_READ


def _append(path: Path, data: bytes) -> None:
    with open(path, "ab") as out:
        out.write(data)


def _step(step: int, loss: float, at: float = 1.0e9) -> bytes:
    return json.dumps({"event": "step", "step": step, "loss": loss, "time": at}).encode() + b"\n"


def _spooled(spool: MetricSpool) -> list[tuple[int, float]]:
    points = [json.loads(line) for line in spool.path.read_text().splitlines()]
    return [(p["step"], p["value"]) for p in points if p["key"] == "train/loss"]


def test_the_metric_tap_passes_over_a_10_mib_line_reading_1_mib_a_poll(tmp_path: Path) -> None:
    progress = tmp_path / "progress.jsonl"
    spool = MetricSpool(tmp_path / "spool", "mlflowrun", "g1-a1")
    tap = MetricTap(progress, spool)
    _append(progress, _step(1, 3.0) + b"x" * (10 << 20))  # no newline yet
    read = []
    for _ in range(12):
        tap.poll()
        read.append(tap.lines.last_read)
    _append(progress, b"\n" + _step(2, 2.0, at=float("inf")) + _step(3, 1.0))
    tap.drain()
    spool.close()
    assert max(read) <= MAX_READ  # before: the first poll read all 10 MiB at once
    # An infinite time costs its own line only; before, it lost the lines after it.
    assert _spooled(spool) == [(1, 3.0), (3, 1.0)]


def test_a_step_line_a_script_wrote_wrong_never_fails_the_heartbeat(tmp_path: Path) -> None:
    progress = tmp_path / "progress.jsonl"
    _append(progress, _step(5, 2.0))
    _append(progress, json.dumps({"event": "step", "step": 6, "loss": "low"}).encode() + b"\n")
    tail = ProgressTail(progress)
    tail.poll()
    reporter = _Reporter("n1", train_input(), tmp_path, tell_cluster=False)
    beats: list = []
    env = ActivityEnvironment()
    env.on_heartbeat = lambda *details: beats.append(details)
    # Before: the tail took loss "low", and the heartbeat's TrainProgress refused it.
    env.run(reporter.progress, dict(tail.latest))
    (beat,) = beats[0]
    assert (beat.step, beat.loss) == (5, 2.0)
