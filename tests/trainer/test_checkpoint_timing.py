"""Checkpoints by time and by the Young/Daly optimum, on real ranks."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

from tests.trainer.conftest import Trainer
from tests.trainer.test_layouts import TRAIN


def checkpoint_events(progress_file: str) -> list[dict]:
    events = [json.loads(line) for line in Path(progress_file).read_text().splitlines()]
    return [e for e in events if e["event"] == "checkpoint"]


def test_auto_saves_at_once_then_by_the_measured_cost(trainer: Trainer) -> None:
    # A gang that fails every 2 s makes the optimum interval (about √(2·C·2 s), at least a
    # commit's time: a few tenths of a second) short enough to see; 200 steps last long enough
    # for several intervals on a busy machine too (40 steps once fitted only one).
    auto = TRAIN.model_copy(update={"checkpoint_every": "auto", "steps": 200})
    job = trainer.job("auto", auto, mtbf_s=2.0)
    trainer.run(job, ranks=2)
    saves = checkpoint_events(job.progress_file)
    assert saves[0]["step"] == 1, "the first step's save measures what a save costs"
    assert saves[-1]["step"] == 200
    assert len(saves) >= 4 and all(s["manifest_key"] for s in saves)


def test_minutes_space_the_saves_by_time(trainer: Trainer) -> None:
    every = {"checkpoint_every": 10**6, "checkpoint_every_minutes": 0.01, "steps": 120}
    job = trainer.job("minutes", TRAIN.model_copy(update=every))
    trainer.run(job, ranks=2)
    saves = checkpoint_events(job.progress_file)
    assert len(saves) >= 2 and saves[-1]["step"] == 120
    # Apart by the interval (0.6 s), between the starts of consecutive timed saves (the last
    # one is the final step's, which always saves).
    started = [s["time"] - s["seconds"] for s in saves[:-1]]
    assert all(b - a >= 0.6 - 0.05 for a, b in itertools.pairwise(started))
