"""`forgeline.report(step, **metrics)`: the one call a script that otherwise never imports
Forgeline makes to show its progress (issue 46, level 1, "as it is").

    import forgeline

    for step in range(1, steps + 1):
        loss = train_one_step()
        if step % 10 == 0:
            forgeline.report(step, loss=loss.item(), lr=scheduler.get_last_lr()[0])
        if step % 500 == 0:
            forgeline.report(step, val_loss=evaluate())

What it needs of the script: nothing else. No `forgeline.init()`, no process group, no
collective: call it on rank 0 only, or on every rank (only each node's local rank 0 writes, so
the lines are the same either way). Each call appends one line to the job's progress file, the
step line the SDK writes: the node agent heartbeats its `step` and `loss` (and `lr`,
`tokens_per_s`, `mfu`, when given), and MLflow gets every metric as `train/<name>`. A metric
named `val_loss` is an evaluation: it goes out as the agent's eval line (`train/val_loss`, the
run's latest held-out loss) instead of a field of the step line. The first call also marks the
script as begun, so a failure after it is a crash, restarted from the last commit, and not the
user's error that fails the run at once (trainer.entry).

What it refuses, with an `SDKUsageError` that names the fix: a step that is not a whole number
of 0 or more, a step lower than this process reported before (a resumed script reports from
where it resumed, not from 0), a metric that is not a finite number (`True` is not one; a
tensor is not either: pass `loss.item()`), and a metric name MLflow would not take
(`forgeline.step.METRIC_NAME`, the rule of the SDK's `step.report`).

At home, with plain `torchrun` (no `FORGELINE_JOB`), it checks its arguments as it does in a
job and writes nothing: the same script runs unchanged in both places, and a bad call fails at
home first.

The module is `reporting`, not `report`: once a submodule `forgeline.report` were imported
(by a test, or by the rank entry's preloading of the SDK), Python would set the package's
`report` to that module, and a script's `forgeline.report(...)` would call a module.
"""

from __future__ import annotations

import functools
import math
import numbers
import operator
import os
from pathlib import Path

from forgeline.errors import SDKUsageError
from forgeline.step import METRIC_NAME
from trainer.entry import mark_began
from trainer.job import TrainJob
from trainer.progress import ProgressFile

# The step line's own fields (trainer.progress_events.StepLine) that the agent heartbeats and
# the metric tap names train/<field>; every other metric goes in the line's "metrics", as the
# SDK's step.report metrics do.
STEP_FIELDS = ("loss", "lr", "tokens_per_s", "mfu")
EVAL_METRIC = "val_loss"


class _Reporter:
    """This process's reports: where they go (read once from the job) and the last step."""

    def __init__(self) -> None:
        job_path = os.environ.get("FORGELINE_JOB", "")
        self.in_a_job = bool(job_path)
        # At home there is no file; in a job only local rank 0 writes (one file a node).
        progress = TrainJob.read(Path(job_path)).progress_file if job_path else ""
        writes = os.environ.get("LOCAL_RANK", "0") == "0"
        self.progress = ProgressFile(progress, enabled=writes)
        self.last_step: int | None = None

    def report(self, step: object, metrics: dict[str, object]) -> None:
        number = _step_number(step, self.last_step)
        values = {name: _metric(name, value) for name, value in metrics.items()}
        # An evaluation at a step already reported adds only its eval line: a second step line
        # for the same step would tell the agent's step rate that a new attempt began.
        if number != self.last_step or values.keys() - {EVAL_METRIC}:
            own = {k: v for k, v in values.items() if k not in STEP_FIELDS and k != EVAL_METRIC}
            fields = {k: values[k] for k in STEP_FIELDS if k in values}
            self.progress.write(event="step", step=number, **fields, metrics=own)
        if EVAL_METRIC in values:
            self.progress.write(event="eval", step=number, val_loss=values[EVAL_METRIC])
        self.last_step = number
        if self.in_a_job:
            mark_began()

    def saved(self, step: object) -> None:
        number = _step_number(step, None)
        self.progress.write(event="saved", step=number)


@functools.cache
def this_process() -> _Reporter:
    """Made at the first report: the job and the rank are the process's for its life."""
    return _Reporter()


def report(step: int, /, **metrics: float) -> None:
    """Report that the script has done `step` steps, with any metrics of that step (see the
    module's docstring): one line to the run's progress file, from each node's local rank 0;
    nothing outside a Forgeline job. Raises SDKUsageError for a bad step or metric."""
    this_process().report(step, metrics)


def saved(step: int, /) -> None:
    """Tell the node agent that a save of `step` into the checkpoint folder is complete, so it
    commits the folder now rather than once the folder has been quiet a while. For the
    integrations (forgeline.integrations), which know when their library's save is done; call
    it from the rank that saved, after the last file is closed. Nothing outside a job."""
    this_process().saved(step)


def _step_number(step: object, last: int | None) -> int:
    try:
        if isinstance(step, bool):
            raise TypeError
        number = operator.index(step)  # an int, or a numpy or 0-d tensor integer
    except TypeError:
        raise SDKUsageError(
            f"forgeline.report(step={step!r}): the step is the number of optimizer steps done, "
            "a whole number (an int)"
        ) from None
    if number < 0:
        raise SDKUsageError(f"forgeline.report(step={number}): the step counts from 0 up")
    if last is not None and number < last:
        raise SDKUsageError(
            f"forgeline.report(step={number}) after step {last}: steps must not go backwards "
            "in a process; report the step the script is at (after a resume, count on from "
            "the resumed step)"
        )
    return number


def _metric(name: str, value: object) -> float:
    if not METRIC_NAME.fullmatch(name):
        raise SDKUsageError(
            f"forgeline.report metric name {name!r}: use 1-200 letters, digits, '_', '-', '.' "
            "or '/'"
        )
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise SDKUsageError(
            f"forgeline.report metric {name}={value!r}: a metric is a number (a float or an "
            "int); for a tensor pass its .item()"
        )
    number = float(value)
    if not math.isfinite(number):
        raise SDKUsageError(
            f"forgeline.report metric {name}={number}: a metric must be finite (a NaN "
            "or infinite loss is a step that diverged: check the value before reporting it)"
        )
    return number
