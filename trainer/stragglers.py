"""Straggler detection: each rank's own compute time against the rest of its gang, per window.

Synchronous training runs at the pace of its slowest rank, and the collectives hide who that is:
every rank's step lasts as long as the slowest rank's. The forward pass is the part a
data-parallel rank does alone (no collective runs in it), so its duration measures the rank's
own speed. (With sharded or tensor-parallel layouts the forward pass gathers weights, the waits
even out, and a slow rank shows much less; there the hang watch and the step time remain.)

A window is at least `window` steps and at least `min_window_s` seconds of steps; when it
closes, each rank's median forward time is compared with the median of the *other* ranks'
medians: leave-one-out, because with two ranks the other one is the only fair yardstick, and
medians, because one slow step (a page fault, a log flush) is not a slow machine. The seconds
matter where steps are short: twenty 25 ms steps are half a second, and a busy host starves a
healthy rank for that long now and then (a process starting, a checkpoint upload); a window
of seconds needs a slow-down that lasts most of it. A rank slower by `factor` in `windows`
consecutive windows is a straggler.

Under a pipeline the stages differ in their work (the first embeds, the last computes the
loss), so a rank is compared with the ranks of its own stage only (`peers`: each rank's stage);
its forward time is its stages' own compute, which `trainer.pipeline` times without the waits
for its neighbours. A slow stage then shows as the rank its peers outpace: the one the whole
gang waits for. Every rank holds the same
gathered times, so every rank reaches the same verdict at the same step without talking.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from statistics import median

import torch


@dataclass(frozen=True)
class Straggler:
    rank: int
    step: int
    ratio: float  # its median forward time over the others', in the last window
    evidence: list[list[float]]  # every rank's median forward time (s), one row per window
    stage: int | None = None  # under a pipeline: the stage whose ranks it was compared with

    def describe(self, ranks_per_node: int) -> str:
        others = "the rest of the gang" if self.stage is None else (
            f"the other ranks of pipeline stage {self.stage}"
        )  # fmt: skip
        return (
            f"rank {self.rank} (node index {self.rank // ranks_per_node}) is {self.ratio:.1f}× "
            f"slower than {others} in {len(self.evidence)} windows in a row "
            f"(median forward time per window, s, rank by rank: "
            f"{[[round(t, 4) for t in row] for row in self.evidence]})"
        )


class StragglerWatch:
    def __init__(
        self,
        window: int,
        factor: float,
        windows: int,
        min_window_s: float = 0.0,
        peers: list[int] | None = None,
    ) -> None:
        self.window = window
        self.peers = peers  # each rank's pipeline stage: compared within it; None: the gang
        self.min_window_s = min_window_s
        self.factor = factor
        self.windows = windows
        self.lost_s = 0.0  # step time spent waiting for the slowest rank, closed windows only
        self._samples: list[list[float]] = []  # this window's forward times, a row per step
        self._window_s = 0.0  # this window's step time, this rank's own
        self._span_s = 0.0  # this window's step time as the gang agreed it (the same everywhere)
        self._history: list[list[float]] = []  # per-window medians, newest last
        self._streak: dict[int, int] = {}  # rank -> consecutive slow windows

    def add(
        self, step: int, forward_s: list[float], step_s: float, gang_step_s: float
    ) -> Straggler | None:
        """One step's forward times, rank by rank; a verdict when a window closes on one.

        `step_s` is this rank's own step time (for the time lost to the slowest rank);
        `gang_step_s` one that every rank holds alike (from the step's all-gather): windows
        close by it, so every rank closes them, and reaches its verdict, at the same step. A
        rank's own clock would let two ranks disagree by a step, one of them checkpointing
        while the other trains on, and the gang would wait on each other for ever."""
        if len(forward_s) < 2:
            return None  # one rank has no one to be slower than
        self._samples.append(forward_s)
        self._window_s += step_s
        self._span_s += gang_step_s
        if len(self._samples) < self.window or self._span_s < self.min_window_s:
            return None
        medians = [median(column) for column in zip(*self._samples, strict=True)]
        ratios = [self._ratio(medians, rank) for rank in range(len(medians))]
        # Had the slowest rank kept the others' pace, the window would have been this much
        # shorter: the gang's time lost to it.
        self.lost_s += self._window_s * (1 - 1 / max(max(ratios), 1.0))
        self._samples.clear()
        self._window_s = self._span_s = 0.0
        self._history = [*self._history, medians][-self.windows :]
        worst: Straggler | None = None
        for rank, ratio in enumerate(ratios):
            self._streak[rank] = self._streak.get(rank, 0) + 1 if ratio >= self.factor else 0
            if self._streak[rank] >= self.windows and (worst is None or ratio > worst.ratio):
                stage = self.peers[rank] if self.peers is not None else None
                evidence = [list(row) for row in self._history]
                worst = Straggler(rank, step, ratio, evidence, stage)
        if worst is not None:
            self._streak.clear()  # reported once per run of slow windows, not every window after
        return worst

    def _ratio(self, medians: list[float], rank: int) -> float:
        """The rank's median over the median of its peers' (every other rank's, or those of
        its pipeline stage); 1 where it has none."""
        peers = self.peers
        others = [
            m
            for r, m in enumerate(medians)
            if r != rank and (peers is None or peers[r] == peers[rank])
        ]
        if not others:
            return 1.0
        return medians[rank] / max(median(others), 1e-9)  # never zero: a ratio divides by it


class ForwardTimer:
    """A step's forward time, as the straggler watch compares it: the host's clock around each
    forward. Right on a CPU, where the forward's work is done when its call returns."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self._seconds = 0.0
        self._started = 0.0

    def start(self) -> None:
        self._started = self._clock()

    def stop(self) -> None:
        self._seconds += self._clock() - self._started

    def seconds(self) -> float:
        """The step's forwards so far, summed."""
        return self._seconds


class DeviceForwardTimer(ForwardTimer):
    """On a GPU the forward's call returns once its kernels are queued: the host's clock
    measures launches, a slow GPU looks as fast as the others and a CPU hiccup looks slow. Here
    a pair of timing events is recorded on the stream around each forward, and the device's
    time between them read at the step's end, after the step's own sync point (the loss's
    read), when they are long done: the read adds no wait of its own."""

    def __init__(self) -> None:
        super().__init__()
        self._pairs: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def start(self) -> None:
        began = torch.cuda.Event(enable_timing=True)
        began.record()
        self._pairs.append((began, torch.cuda.Event(enable_timing=True)))

    def stop(self) -> None:
        self._pairs[-1][1].record()

    def seconds(self) -> float:
        if self._pairs:
            self._pairs[-1][1].synchronize()  # done already after the step's sync point
        # elapsed_time is in milliseconds.
        return sum(began.elapsed_time(ended) for began, ended in self._pairs) / 1000


def forward_timer(device: torch.device) -> ForwardTimer:
    """The forward's timer for the device it runs on: the device's own clock on a GPU."""
    return DeviceForwardTimer() if device.type == "cuda" else ForwardTimer()
