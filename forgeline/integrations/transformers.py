"""Hugging Face `Trainer` on Forgeline: one callback, and the folder the Trainer saves into.

    from forgeline.integrations.transformers import ForgelineCallback, last_checkpoint

    trainer = Trainer(model, args, train_dataset=..., callbacks=[ForgelineCallback()])
    trainer.train(resume_from_checkpoint=last_checkpoint(args.output_dir))

with a spec that gives the script its checkpoint folder as the output folder:

    [train]
    checkpoints = "folder"
    argv = ["--output-dir", "{checkpoint_dir}"]

What the callback does:
- every log of the Trainer (`logging_steps`, evaluations) is reported at its global step
  (`forgeline.report`): `loss` and `learning_rate` (as `lr`) reach the heartbeats, every finite
  number reaches MLflow as `train/<name>`, and `eval_loss` is the run's held-out loss (`val_loss`),
  which the eval gate judges as self-reported;
- each `checkpoint-N` folder the Trainer saves is committed by the node agent as soon as the
  Trainer has written it (`on_save` tells the agent: `forgeline.reporting.saved`);
- a SIGTERM (a preemption or a drain) becomes a save at the end of the step every rank agrees
  on (forgeline.integrations.stop_request) and a clean end of `train()`: the script returns,
  and the agent commits that last save.

`last_checkpoint(output_dir)` is the newest `checkpoint-N` there: after a restart it is the one
the node agent restored from the last commit, so the Trainer resumes its model, optimizer,
scheduler, RNG states and data position from it. At home it is whatever the folder holds.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

from forgeline.integrations.reported_metrics import reportable
from forgeline.integrations.stop_request import StopRequest
from forgeline.reporting import report, saved

# The Trainer's names for what Forgeline's progress lines call otherwise.
RENAMED = {"learning_rate": "lr", "eval_loss": "val_loss"}


class ForgelineCallback(TrainerCallback):
    """Metrics to the run, and a SIGTERM turned into a save and a clean stop. Make it in the
    main thread (it installs the SIGTERM handler), before `trainer.train()`."""

    def __init__(self) -> None:
        self.stop = StopRequest()

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        metrics = reportable(logs or {}, RENAMED)
        # One writer is enough (forgeline.report writes on each node's first rank anyway).
        if metrics and state.is_world_process_zero:
            report(state.global_step, **metrics)

    def on_save(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        # Called once checkpoint-N is written and older ones rotated out: commit it now.
        if state.is_world_process_zero:
            saved(state.global_step)

    def on_step_end(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> TrainerControl:
        if self.stop.agreed():
            control.should_save = True
            control.should_training_stop = True
        return control


def last_checkpoint(output_dir: str | os.PathLike[str]) -> str | None:
    """The newest `checkpoint-N` folder in `output_dir`, for `resume_from_checkpoint`; None
    when there is none (the run's first gang, or a folder that does not exist yet)."""
    if not Path(output_dir).is_dir():
        return None
    return get_last_checkpoint(str(output_dir))
