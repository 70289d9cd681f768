"""Finite outliers: a rank whose own gradient norm jumps, judged against its own history and
against the rest of the gang's, by the median absolute deviation (MAD) over a window.

A device that is wrong rather than dead gives finite, plausible numbers; the NaN check
(`trainer.grad_watch.suspects`) never sees them. What it can change is the norm of the gradients
a rank computed itself (before the all-reduce under DDP, its shards under FSDP or TP). Two
signals, both in log space, since norms vary by factors rather than by amounts:

- its own history: log(norm) against the median of its last `window` steps;
- the gang's: log(norm) minus the log of the others' median at the same step, against that
  ratio's own history. Like is compared with like: under FSDP or TP a rank's shards differ from
  another's, but the ratio between them is steady, so each rank is measured against itself.

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
    window: int = 50

    @property
    def min_history(self) -> int:
        """Steps of history before a rank is judged: a whole window. Early in training the
        norms fall fast and a short history misjudges them: on a clean 4-replica DDP run of
        the test model, judged after 10 steps the worst rank stood 12.9 MADs out (two false
        suspects at 10); after a full window of 50, 3.4."""
        return self.window

    @classmethod
    def from_dict(cls, data: dict) -> SpikeSettings:
        return cls(**data) if data else cls()


@dataclass(frozen=True)
class Spike:
    step: int
    rank: int | None  # None: the whole run spiked (no rank stands out)
    norm: float  # the rank's gradient norm at `step` (for the run: the ranks' median)
    typical: float  # its median over the window before
    mads: float  # how far, in MADs of its own history

    def describe(self, ranks_per_node: int) -> str:
        what = (
            f"the gradient norm of every rank (median {self.norm:.4g})"
            if self.rank is None
            else f"rank {self.rank}'s own gradient norm {self.norm:.4g} "
            f"(node index {self.rank // ranks_per_node})"
        )
        return (
            f"{what} at step {self.step} is {self.mads:.1f} MADs from its median "
            f"{self.typical:.4g} over the steps before"
        )


class _History:
    """The last `window` values of one series (log units) and how far a new one lies from them."""

    def __init__(self, window: int) -> None:
        self.values: deque[float] = deque(maxlen=window)

    def deviation(self, value: float, min_history: int) -> float:
        """Signed distance of `value` from the median, in MADs; 0 until there is history."""
        if len(self.values) < min_history:
            return 0.0
        middle = median(self.values)
        mad = median(abs(v - middle) for v in self.values)
        return (value - middle) / max(_MAD_TO_SIGMA * mad, _SCALE_FLOOR)

    def typical(self) -> float:
        return math.exp(median(self.values))


class SpikeWatch:
    def __init__(self, settings: SpikeSettings, world: int) -> None:
        self.settings = settings
        self._own = [_History(settings.window) for _ in range(world)]
        self._ratio = [_History(settings.window) for _ in range(world)]
        self._run = _History(settings.window)

    def add(self, step: int, norms: list[float]) -> list[Spike]:
        """This step's norms by rank; the suspects among them (and the run's own spike)."""
        threshold = self.settings.mads
        if threshold <= 0 or not all(math.isfinite(n) and n > 0 for n in norms):
            return []  # off, or a non-finite step: the NaN check has it; a zero norm: no signal
        logs = [math.log(n) for n in norms]
        least = self.settings.min_history
        own = [h.deviation(v, least) for h, v in zip(self._own, logs, strict=True)]
        ratios = [v - _median_of_others(logs, rank) for rank, v in enumerate(logs)]
        gang = [h.deviation(r, least) for h, r in zip(self._ratio, ratios, strict=True)]
        found = [
            Spike(step, rank, norms[rank], self._own[rank].typical(), own[rank])
            for rank in range(len(norms))
            if len(norms) > 1 and abs(own[rank]) > threshold and abs(gang[rank]) > threshold
        ]
        run = self._run.deviation(median(logs), least)
        jumped = sum(1 for d in own if d > threshold)
        if not found and run > threshold and jumped > len(norms) // 2:
            found.append(Spike(step, None, median(norms), self._run.typical(), run))
        for history, value in zip(self._own, logs, strict=True):
            history.values.append(value)
        for history, value in zip(self._ratio, ratios, strict=True):
            history.values.append(value)
        self._run.values.append(median(logs))
        return found


def _median_of_others(values: list[float], rank: int) -> float:
    others = values[:rank] + values[rank + 1 :]
    return median(others) if others else 0.0
