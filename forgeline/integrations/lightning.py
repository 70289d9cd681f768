"""Lightning on Forgeline: one callback, and the folder the checkpoints are saved into.

    from forgeline.integrations.lightning import ForgelineCallback, last_checkpoint

    saves = ModelCheckpoint(dirpath=out, every_n_train_steps=50, save_last=True,
                            enable_version_counter=False)
    trainer = L.Trainer(max_steps=..., callbacks=[saves, ForgelineCallback(saves)])
    trainer.fit(model, data, ckpt_path=last_checkpoint(out))

with a spec that gives the script its checkpoint folder as `out`:

    [train]
    checkpoints = "folder"
    argv = ["--out", "{checkpoint_dir}"]

What the callback does:
- every `log_every_n_steps` optimizer steps, the finite numbers the module logged (`self.log`)
  are reported at the global step (`forgeline.report`): `loss` reaches the heartbeats, every
  value MLflow as `train/<name>`, and `val_loss` is the run's held-out loss, which the eval gate
  judges as self-reported;
- each `.ckpt` the `ModelCheckpoint` saves is committed by the node agent as soon as it is
  written (Lightning runs the ModelCheckpoint after the other callbacks, so the callback sees
  the save at the next batch's end and tells the agent the save's own step);
- a SIGTERM (a preemption or a drain) becomes, at the end of the batch every rank agrees on
  (forgeline.integrations.stop_request), a save of `last.ckpt` and a clean end of `fit()`: the
  script returns, and the agent commits that save.

`last_checkpoint(dirpath)` is `last.ckpt` there when it exists: after a restart, the one the
node agent restored from the last commit, from which `fit(ckpt_path=...)` resumes the module,
the optimizers, the schedulers and the loop's position.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint

from forgeline.integrations.reported_metrics import reportable
from forgeline.integrations.stop_request import StopRequest
from forgeline.reporting import report, saved

LAST = ModelCheckpoint.CHECKPOINT_NAME_LAST + ModelCheckpoint.FILE_EXTENSION  # "last.ckpt"


class ForgelineCallback(pl.Callback):
    """Metrics to the run, and a SIGTERM turned into a save and a clean stop. `saves`: the
    ModelCheckpoint whose folder Forgeline commits (the stop's save goes there, as last.ckpt).
    Make it in the main thread (it installs the SIGTERM handler), before `fit()`."""

    def __init__(self, saves: ModelCheckpoint) -> None:
        # A restart resumes from last.ckpt, so it must be saved, and overwritten: a
        # ModelCheckpoint that finds a last.ckpt it did not write (the restored one) would
        # otherwise save last-v1.ckpt beside it, and the next restart resume from the old one.
        if not saves.save_last or getattr(saves, "_enable_version_counter", False):
            raise ValueError(
                "forgeline.integrations.lightning resumes from last.ckpt: make the "
                "ModelCheckpoint with save_last=True and enable_version_counter=False"
            )
        self.saves = saves
        self.stop = StopRequest()
        self._reported_step = -1
        self._seen_save: tuple[object, ...] | None = None  # the newest save told to the agent

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # fit() has put Lightning's own SIGTERM handler in place by now. It broadcasts from
        # inside the handler, which can land in the middle of the step's all-reduce and hang
        # the gang, then raises out of fit(): a crash, not a stop. Ours only notes the request.
        self.stop.install()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
        batch_idx: int,
    ) -> None:  # fmt: skip
        step = trainer.global_step
        due = step % max(trainer.log_every_n_steps, 1) == 0 and step != self._reported_step
        if due:
            # Read on every rank: a value logged with sync_dist is reduced over the gang when
            # it is read, and a read on rank 0 alone would wait for the others for ever.
            metrics = reportable(trainer.callback_metrics, {})
            self._reported_step = step
            if metrics and trainer.is_global_zero:
                report(step, **metrics)
        stopping = self.stop.agreed()
        if stopping:
            # Every rank calls it (the save is collective; global rank 0 writes).
            trainer.save_checkpoint(Path(self.saves.dirpath or trainer.default_root_dir) / LAST)
            trainer.should_stop = True
        # The ModelCheckpoint (before this callback in the list) has saved in this hook when
        # its newest path changed: the save is complete, commit it now.
        newest = self._newest_save()
        if trainer.is_global_zero and (stopping or newest != self._seen_save):
            self._seen_save = newest
            # Lightning runs the ModelCheckpoint after the other callbacks: its save at the
            # previous batch's end is seen here one batch later, and says its own step.
            at = getattr(self.saves, "_last_global_step_saved", step) if not stopping else step
            saved(at)

    def _newest_save(self) -> tuple[object, ...]:
        """What changes with each save of the ModelCheckpoint: the step it saved at (kept in
        an attribute of its own), and its paths, which alone do not change for last.ckpt."""
        saves = self.saves
        step = getattr(saves, "_last_global_step_saved", None)
        return (step, saves.last_model_path, saves.best_model_path)


def last_checkpoint(dirpath: str | os.PathLike[str]) -> str | None:
    """`last.ckpt` in `dirpath`, for `fit(ckpt_path=...)`; None when there is none (the run's
    first gang, or a folder that does not exist yet)."""
    last = Path(dirpath) / LAST
    return str(last) if last.is_file() else None
