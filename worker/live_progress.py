"""Progress bars for a person at a terminal: `forgeline run` and `forgeline data prepare` draw
one bar per data stage and one for the training steps, each with its rate and an ETA, from the
same data the heartbeats carry (the run's view, the dataset's stage counts). Where the output
is not a terminal (a log, CI) the commands print a line per change instead."""

from __future__ import annotations

from types import TracebackType

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
)

from worker.render import eta_of, eta_text
from workflows.contracts.api_models import RunView
from workflows.contracts.models import DatasetProgress

TRAIN = "train"


class LiveProgress:
    def __init__(self, console: Console) -> None:
        self.bars = Progress(
            TextColumn("{task.description:<8}"),
            BarColumn(bar_width=30),
            MofNCompleteColumn(),
            TextColumn("{task.fields[rate]}"),
            TextColumn("ETA {task.fields[eta]}"),
            TextColumn("{task.fields[note]}"),
            console=console,
            refresh_per_second=4,
        )
        self._tasks: dict[str, TaskID] = {}

    def __enter__(self) -> LiveProgress:
        self.bars.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.bars.stop()

    def _bar(self, name: str, done: int, total: int | None, **fields: str) -> None:
        if name not in self._tasks:
            self._tasks[name] = self.bars.add_task(name, total=total, rate="", eta="-", note="")
        self.bars.update(self._tasks[name], completed=done, total=total, **fields)

    def stages(self, progress: DatasetProgress) -> None:
        """A data stage counts its units (files, shards): rich times their rate between polls."""
        for stage in progress.stages:
            self._bar(stage.name, stage.done, stage.total or None)
            task = self.bars.tasks[self._tasks[stage.name]]
            speed, left = task.speed, task.time_remaining
            self.bars.update(
                self._tasks[stage.name],
                rate=f"{speed:,.1f}/s" if speed else "",
                eta=eta_text(left) if left is not None and not task.finished else "-",
            )

    def run(self, view: RunView) -> None:
        if view.dataset is not None:
            self.stages(view.dataset)
        beat = view.progress
        if beat is None:
            return
        rate = f"{beat.steps_per_s:.2f} steps/s" if beat.steps_per_s else ""
        if beat.tokens_per_s:
            rate += f"  {beat.tokens_per_s:,.0f} tokens/s"
        note = f"loss {beat.loss:.4f}" if beat.loss is not None else ""
        if beat.checkpoint_step is not None:
            note += f"  ckpt {beat.checkpoint_step}"
        eta = eta_text(eta_of(view))
        self._bar(TRAIN, beat.step, beat.total_steps or None, rate=rate, eta=eta, note=note)
