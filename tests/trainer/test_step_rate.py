"""The step rate an ETA divides by (trainer/step_rate.py), and the agent's tail reading it from
the ranks' progress lines."""

from __future__ import annotations

import json
from pathlib import Path

from trainer.progress_tail import ProgressTail
from trainer.step_rate import StepRate


def test_steps_per_second_over_the_newest_window_by_the_ranks_clocks() -> None:
    rate = StepRate(window=3)
    assert rate.per_s is None
    rate.add(10, 100.0)
    assert rate.per_s is None
    for step, at in ((11, 100.5), (12, 101.0), (13, 103.0)):  # a save stalled the last step
        rate.add(step, at)
    assert rate.per_s == 2 / 2.5  # steps 11-13 only: the window is three lines
    rate.add(5, 200.0)  # a new attempt from an earlier checkpoint starts its own count
    assert rate.per_s is None


def test_the_agent_s_tail_reports_the_rate(tmp_path: Path) -> None:
    progress = tmp_path / "progress.jsonl"
    lines = [{"event": "step", "step": s, "time": 1000.0 + s / 4, "loss": 1.0} for s in range(9)]
    progress.write_text("".join(json.dumps(line) + "\n" for line in lines))
    tail = ProgressTail(progress)
    tail.poll()
    assert tail.latest["step"] == 8 and tail.latest["steps_per_s"] == 4.0
