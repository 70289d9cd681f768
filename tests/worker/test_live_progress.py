"""The bars `forgeline run` and `data prepare` draw at a terminal (worker/live_progress.py):
the steps with their rate, tokens/s and ETA, the data stages with their counts."""

from __future__ import annotations

from rich.console import Console

from tests.worker.test_render import training_view
from worker.live_progress import LiveProgress
from workflows.contracts.models import DatasetProgress, StageProgress


def _drawn(live: LiveProgress, console: Console) -> str:
    console.print(live.bars.get_renderable())
    return console.export_text()


def test_the_training_bar_shows_steps_rate_and_eta() -> None:
    console = Console(force_terminal=True, width=160, record=True)
    live = LiveProgress(console)
    view = training_view()
    view.progress.steps_per_s = 2.5  # type: ignore[union-attr]
    live.run(view)
    text = _drawn(live, console)
    assert "train" in text and "230/600" in text
    assert "2.50 steps/s  20,500 tokens/s" in text and "ETA 2m28s" in text
    assert "loss 2.2500  ckpt 200" in text


def test_each_data_stage_has_a_bar_with_its_count() -> None:
    console = Console(force_terminal=True, width=160, record=True)
    live = LiveProgress(console)
    live.stages(DatasetProgress(stages=[StageProgress(name="scan", done=7, total=10),
                                        StageProgress(name="dedup", done=0, total=0)]))  # fmt: skip
    text = _drawn(live, console)
    assert "scan" in text and "7/10" in text
    assert "dedup" in text and "0/?" in text  # no total known yet
