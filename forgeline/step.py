"""One step of the training loop as the SDK hands it to a rank script (`Run.steps()`)."""

from __future__ import annotations

import contextlib
import math
import re
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from forgeline.errors import SDKUsageError
from trainer.data import to_device
from trainer.grad_watch import chaos_poison, corrupt_gradients
from trainer.parallel import clip_grad_norm, local_grad_norm
from trainer.shadow_check import Verdict
from trainer.stragglers import forward_timer

if TYPE_CHECKING:
    from forgeline.training import Run

# What MLflow accepts as a metric key (and what stays one path segment under train/).
METRIC_NAME = re.compile(r"[A-Za-z0-9_.\-/]{1,200}")


class Step:
    """One optimizer step of the loop, as `Run.steps()` hands it out.

    `number` counts steps done once this one is (1 for the first step of a run): the number
    that the logs, the checkpoints and the learning-rate schedule use.
    """

    def __init__(self, run: Run, number: int) -> None:
        self.run = run
        self.number = number
        self.loss: torch.Tensor | None = None  # set by report()
        self.metrics: dict[str, float] = {}
        self._forward = forward_timer(run.device)
        self.forward_s = 0.0  # the forwards' time, read by _settle()
        self.own_loss = math.nan  # the loss as a number, read by _settle()
        self.grad_norm: float | None = None  # set by gradients()
        self.finite = True
        self.verdict: Verdict | None = None  # a shadow check's, set by gradients()
        self.shadow_s = 0.0  # the shadow check's time (goodput's own cause)
        self.micro_index = 0  # the micro-batch micro_batches() handed out last, from 1
        self.weights_changed = False  # the script's optimizer stepped in this step
        self.started = time.perf_counter()

    def micro_batches(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's (inputs, targets) of the step, one pair per gradient-accumulation
        micro-batch, on the run's device: its slice of the global batch at the data cursor."""
        run = self.run
        sampler = run.sampler
        if sampler is None:
            raise SDKUsageError("call run.dataset(block_size) before step.micro_batches()")
        batches = sampler.micro_batches(run.samples_seen)
        while True:
            started = time.perf_counter()  # the sampler's time is the SDK's, not the script's
            batch = next(batches, None)
            if batch is None:
                run._sdk_s += time.perf_counter() - started
                return
            indices, x, y = batch
            if run._sample_log is not None:
                run._sample_log.write(f"{self.number - 1} {run.rank} "
                                      f"{' '.join(map(str, indices.tolist()))}\n")  # fmt: skip
            x, y = to_device(x, run.device), to_device(y, run.device)
            self.micro_index += 1
            run._sdk_s += time.perf_counter() - started
            yield x, y

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        """Wrap the forward pass: its time is each rank's own speed, which the straggler watch
        compares across the gang (the forward runs no collective under DDP). Under it, bf16
        autocast on GPUs. On a GPU it is timed by the device's clock (trainer.stragglers)."""
        self._forward.start()
        with self.run.autocast():
            yield
        self._forward.stop()

    def gradients(self, model: torch.nn.Module, max_norm: float = 0.0) -> float:
        """Call after backward: this rank's local gradient norm, checked for non-finite values
        (for DDP and FSDP, the norm of this rank's own gradients before the reduction mixed
        them: what names the rank that went bad). With `max_norm` > 0 it also clips every gradient
        by the global norm, as `torch.nn.utils.clip_grad_norm_` would, taking the norm once for
        both where each rank holds whole gradients (one rank, DDP)."""
        run = self.run
        hooked = run._own_norms is not None  # DDP, FSDP: the reduction watch poisons
        scale = None if hooked else chaos_poison(run._corrupt_next, self.number)
        if scale is not None:
            corrupt_gradients(model, scale)  # no all-reduce hook to do it in: after backward
        if run._checks is not None:  # before clipping changes the gradients
            started = time.perf_counter()
            self.verdict = run._checks.after_backward(self, model)
            self.shadow_s = time.perf_counter() - started
        # The step's reads before the optimizer's: the local norm (the host decides whether to
        # clip by it, and the script gets it as a number) waits for the backward; the own norm,
        # summed on the device by the reduction's hooks, is read right after, with nothing
        # queued before it left to wait for.
        norm, whole = local_grad_norm(model)
        own = run._own_norms.take() if run._own_norms is not None else norm
        self.finite = self.finite and math.isfinite(norm)
        if max_norm > 0:
            pipeline = run._pipeline  # a stage's norm is part of the model's
            known = norm if whole and pipeline is None else None
            clip_grad_norm(model, max_norm, total=known, pipeline=pipeline)
        self.grad_norm = own
        return own

    def report(self, loss: torch.Tensor | float, **metrics: float) -> None:
        """This rank's loss of the step (a tensor is fine: the SDK reads it once, after the
        step, to check it is finite) and any metrics of the script's own. Every `log_every`
        steps the loss is averaged over the ranks and goes, with the metrics, to the heartbeats
        and to MLflow."""
        for name in metrics:
            if not METRIC_NAME.fullmatch(name):
                raise SDKUsageError(
                    f"metric name {name!r}: use 1-200 letters, digits, '_', '-', '.' or '/'"
                )
        self.loss = loss if isinstance(loss, torch.Tensor) else torch.tensor(float(loss))
        self.metrics.update({k: float(v) for k, v in metrics.items()})

    def _settle(self) -> None:
        """Read what the step left on the device, once, after the script's part of it: its loss
        (the step's sync point on a GPU: the read waits for the device to finish the step) and
        then its forwards' time, by then measured. `Run.steps` calls it before the SDK's clock
        starts, so that wait is booked as the step's compute, not as the platform's share."""
        if self.loss is not None:
            self.own_loss = float(self.loss)
        pipeline = self.run._pipeline  # its stages time their own forwards, waits left out
        self.forward_s = pipeline.take_forward_s() if pipeline else self._forward.seconds()
