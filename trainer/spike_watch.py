"""Finite outliers: a rank whose own gradient norm or loss jumps, judged against its own history
and against the rest of the gang's, by the median absolute deviation (MAD) over a window.

A device that is wrong rather than dead gives finite, plausible numbers; the NaN check
(`trainer.grad_watch.suspects`) never sees them. What it can change is the norm of the gradients
a rank computed itself (before the reduction under DDP and FSDP, its shards under TP). Two
signals, in log space for norms (they vary by factors rather than by amounts):

- its own history: log(norm) against the median of its last `window` steps;
- the gang's: log(norm) minus the log of the others' median at the same step, against that
  ratio's own history. Like is compared with like: under TP a rank's shards differ from
  another's, but the ratio between them is steady, so each rank is measured against itself.

Each rank's own loss (the micro-batch it computed) is watched the same way, as it is: a wrong
forward pass shows there before it shows in any gradient.

A rank is a suspect when both move by more than `mads` MADs: its own history alone cannot tell
a bad device from a spike the whole run has (a hard batch, a learning-rate change), and with two
ranks the ratio moves for both. When most ranks' own norms jump together and no ratio does, the
run itself spiked: reported without a rank (with one rank, every spike is of that kind). A
suspect is evidence, not a verdict: the shadow recompute decides (issue 19, part 2).

Every rank gathers every rank's norm each step (`trainer.step_share`), so every rank reaches the
same findings from the same numbers. The first `window` steps of an attempt are not judged: the
history starts again with each attempt, and a shorter one misjudges early training.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from statistics import median

# The MAD of a normal distribution is this fraction of its standard deviation: dividing by it
# makes `mads` read like standard deviations for well-behaved noise.
_MAD_TO_SIGMA = 1.4826
# A history this flat (every norm alike, as in a deterministic toy run) would make any change
# infinitely many MADs: the scale is never below this, in log units (about 1 %).
_SCALE_FLOOR = 0.01


@dataclass(frozen=True)
class SpikeSettings:
    """What the spec's `[recovery]` says (`suspect_mads`, `suspect_window_steps`); in the job
    file as a dict (`TrainJob.spikes`)."""

    mads: float = 0.0  # 0: off
    # Also the history a rank needs before it is judged: early in training the norms fall fast
    # and a short history misjudges them. On a clean 4-replica DDP run of the test model,
    # judged after 10 steps the worst rank stood 12.9 MADs out (two false suspects at 10);
    # after a full window of 50, 3.4.
    window: int = 50

    @classmethod
    def from_dict(cls, data: dict) -> SpikeSettings:
        return cls(**data)


@dataclass(frozen=True)
class Spike:
    step: int
    rank: int | None  # None: the whole run spiked (no rank stands out)
    signal: str  # "gradient norm" or "loss"
    value: float  # the rank's at `step` (for the run: the ranks' median)
    typical: float  # its median over the window before
    mads: float  # how far, in MADs of its own history

    def describe(self, ranks_per_node: int) -> str:
        what = (
            f"the {self.signal} of every rank (median {self.value:.4g})"
            if self.rank is None
            else f"rank {self.rank}'s own {self.signal} {self.value:.4g} "
            f"(node index {self.rank // ranks_per_node})"
        )
        return (
            f"{what} at step {self.step} is {self.mads:.1f} MADs from its median "
            f"{self.typical:.4g} over the steps before"
        )


class _History:
    """The last `window` values of one series and how far a new one lies from them."""

    def __init__(self, window: int, relative_floor: bool) -> None:
        self.values: deque[float] = deque(maxlen=window)
        self.relative_floor = relative_floor

    def deviation(self, value: float) -> float:
        """Signed distance of `value` from the median, in MADs; 0 until the window is full."""
        if len(self.values) < (self.values.maxlen or 0):
            return 0.0
        middle = median(self.values)
        mad = median(abs(v - middle) for v in self.values)
        floor = _SCALE_FLOOR * abs(middle) if self.relative_floor else _SCALE_FLOOR
        return (value - middle) / max(_MAD_TO_SIGMA * mad, floor, 1e-12)


class _Signal:
    """One quantity every rank reports each step, watched both ways (the module docstring).
    Gradient norms are positive and vary by factors: judged as logarithms. A loss may be any
    number (a script's own objective) and varies by amounts: judged as it is."""

    def __init__(self, name: str, logarithmic: bool, window: int, world: int) -> None:
        self.name = name
        self.logarithmic = logarithmic
        relative = not logarithmic
        self._own = [_History(window, relative) for _ in range(world)]
        self._gap = [_History(window, relative) for _ in range(world)]
        self._run = _History(window, relative)

    def _unit(self, value: float) -> float:
        return math.log(value) if self.logarithmic else value

    def _typical(self, history: _History) -> float:
        middle = median(history.values)
        return math.exp(middle) if self.logarithmic else middle

    def add(self, step: int, values: list[float], threshold: float) -> list[Spike]:
        if not all(math.isfinite(v) for v in values):
            return []  # the NaN check's (trainer.grad_watch.suspects)
        if self.logarithmic and not all(v > 0 for v in values):
            return []  # a zero norm (nothing trained on this rank): no signal
        units = [self._unit(v) for v in values]
        own = [h.deviation(u) for h, u in zip(self._own, units, strict=True)]
        gaps = [u - _median_of_others(units, rank) for rank, u in enumerate(units)]
        gang = [h.deviation(g) for h, g in zip(self._gap, gaps, strict=True)]
        found = [
            Spike(step, rank, self.name, values[rank], self._typical(self._own[rank]), own[rank])
            for rank in range(len(values))
            if len(values) > 1 and abs(own[rank]) > threshold and abs(gang[rank]) > threshold
        ]
        run = self._run.deviation(median(units))
        jumped = sum(1 for d in own if d > threshold)
        if not found and run > threshold and jumped > len(values) // 2:
            found.append(
                Spike(step, None, self.name, median(values), self._typical(self._run), run)
            )
        for history, unit in zip(self._own, units, strict=True):
            history.values.append(unit)
        for history, gap in zip(self._gap, gaps, strict=True):
            history.values.append(gap)
        self._run.values.append(median(units))
        return found


class SpikeWatch:
    def __init__(self, settings: SpikeSettings, world: int) -> None:
        self.settings = settings
        self._norms = _Signal("gradient norm", True, settings.window, world)
        self._losses = _Signal("loss", False, settings.window, world)

    def add(self, step: int, norms: list[float], losses: list[float] | None = None) -> list[Spike]:
        """This step's gradient norms and losses by rank: the suspects among them (and the
        run's own spikes). Without losses (a script that reports none), the norms alone."""
        threshold = self.settings.mads
        if threshold <= 0:
            return []
        found = self._norms.add(step, norms, threshold)
        if losses is not None:
            found += self._losses.add(step, losses, threshold)
        return found


def _median_of_others(values: list[float], rank: int) -> float:
    others = values[:rank] + values[rank + 1 :]
    return median(others) if others else 0.0
