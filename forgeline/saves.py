"""A run's checkpoints as its loop sees them: one asynchronous save in flight, its commit
reported to the node agent (progress file) and the goodput ledger when it lands, and the
measured costs that the interval policy (`checkpoint_every = "auto"`) needs."""

from __future__ import annotations

import time

import torch

from trainer.attempt_clock import AttemptClock
from trainer.checkpoint import Checkpointer, SaveReport
from trainer.progress import ProgressFile


class Saves:
    def __init__(
        self,
        checkpointer: Checkpointer,
        clock: AttemptClock,
        progress: ProgressFile,
        committed_step: int | None,
    ) -> None:
        self.checkpointer = checkpointer
        self.clock = clock
        self.progress = progress
        self.last_committed = committed_step  # the newest step whose manifest committed
        self.last_issued: int | None = None  # the newest step a store save was started for
        self.costs: tuple[float | None, float | None] = (None, None)  # stall, save to commit
        self.last_save_at = time.monotonic()

    @property
    def fenced(self) -> bool:
        """A later generation owns the run: this one commits nothing more."""
        return self.checkpointer.fenced

    def save(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        step: int,
        meta: dict,
        *,
        peer: bool = False,
        extra: dict | None = None,
    ) -> None:
        """Start a save of this step (`peer`: of the peer tier; `extra`: the script's own
        state, `forgeline.kept_state`); returns once the state is being copied."""
        if not peer:  # the interval policy times the store's checkpoints
            self.last_save_at = time.monotonic()
            self.last_issued = step
        started = time.monotonic()
        self.clock.save_issued(step)
        previous = self.checkpointer.save(model, optimizer, step, meta, peer=peer, extra=extra)
        self._report(previous)  # the one before
        self.clock.add(stall_s=time.monotonic() - started)

    def poll(self) -> None:
        """Report a save that committed since the last look, without waiting."""
        self._report(self.checkpointer.poll())

    def holds(self, step: int) -> bool:
        """A store checkpoint of `step` is committed or on its way (the resume point counts)."""
        return step in (self.last_committed, self.last_issued)

    def wait(self, timeout: float | None = None) -> None:
        """Wait for the save in flight to commit (before a stop: only then is it safe); with
        `timeout`, at most that long (trainer.checkpoint.Checkpointer.wait)."""
        waited = time.perf_counter()
        self._report(self.checkpointer.wait(timeout))
        self.clock.add(stall_s=time.perf_counter() - waited)

    def close(self) -> None:
        self.checkpointer.close()

    def _report(self, report: SaveReport | None) -> None:
        if report is None:
            return
        if report.peer:  # work kept, but not a store checkpoint the workflows resume from
            if report.manifest_key is not None:
                self.clock.committed(report.step)
            self.progress.write(event="peer_checkpoint", step=report.step,
                                manifest_key=report.manifest_key, seconds=report.total_s,
                                stall_s=report.stall_s)  # fmt: skip
            return
        self.costs = (report.stall_s, report.total_s)
        if report.manifest_key is not None:
            self.last_committed = report.step
            self.clock.committed(report.step)
        self.progress.write(
            event="checkpoint",
            step=report.step,
            manifest_key=report.manifest_key,
            seconds=report.total_s,
            stall_s=report.stall_s,
            **({"lost": report.lost} if report.lost else {}),
        )
