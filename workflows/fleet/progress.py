"""One attempt of a job, as arithmetic: restart, then periods of `interval` work + a save.

An attempt granted at `granted` spends `restart` s starting (spawn, rendezvous, load the last
checkpoint), then works in periods of `interval` seconds, each followed by a blocking save of
`save` seconds that commits the work before it. A failure keeps what the last committed save
holds; a preemption notice makes the run save at once, keeping everything done so far. Times
are seconds since the simulation started.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Attempt:
    granted: float
    restart: float
    interval: float
    save: float
    remaining: float  # work left when granted, in seconds of the gang's compute

    @property
    def work_start(self) -> float:
        return self.granted + self.restart

    @property
    def end(self) -> float:
        """When the job is done, its final save included."""
        saves = max(1, math.ceil(self.remaining / self.interval))
        return self.work_start + self.remaining + saves * self.save

    def committed(self, t: float) -> float:
        """Work held by the last save committed by `t`: what a failure at `t` keeps."""
        if t >= self.end:
            return self.remaining
        periods = math.floor(max(0.0, t - self.work_start) / (self.interval + self.save))
        return min(periods * self.interval, self.remaining)

    def done(self, t: float) -> float:
        """Work done by `t`, saved or not: what a save started at `t` keeps."""
        if t >= self.end:
            return self.remaining
        elapsed = max(0.0, t - self.work_start)
        period = self.interval + self.save
        periods = math.floor(elapsed / period)
        return min(periods * self.interval + min(elapsed - periods * period, self.interval),
                   self.remaining)  # fmt: skip

    def wall(self, work: float) -> float:
        """Seconds from the work's start that `work` of it takes, saves included."""
        return work + math.floor(work / self.interval) * self.save

    def preempted(self, notice: float, grace: float) -> tuple[float, float]:
        """(release time, work kept) for a notice at `notice`: save now if the save fits in the
        grace period, else whatever was committed when the grace runs out."""
        if notice < self.work_start:  # still starting: nothing to save
            return notice, 0.0
        if self.save <= grace:
            return notice + self.save, self.done(notice)
        return notice + grace, self.committed(notice + grace)
