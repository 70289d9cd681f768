"""A gang that stops making progress without a word: a stuck collective announces nothing.

The ranks of a hung gang neither fail nor exit (gloo would give up only after the collective
timeout, minutes later), and their node agents keep heartbeating. So the agent watches the
steps its ranks report: no progress for `factor` times the gang's own median time between
progress reports, and at least `floor_s`, is a hang.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field


@dataclass
class HangWatch:
    factor: float
    floor_s: float
    _step: int | None = None
    _since: float | None = None  # when the step last advanced
    _gaps: list[float] = field(default_factory=list)  # seconds between advances, recent ones

    def observe(self, step: int, now: float) -> None:
        if self._step is None or step < self._step:  # first report, or a new start
            self._step, self._since = step, now
            return
        if step > self._step:
            assert self._since is not None
            self._gaps = [*self._gaps[-49:], now - self._since]
            self._step, self._since = step, now

    def limit_s(self) -> float | None:
        """How long without progress counts as a hang; None until progress has been seen."""
        if not self._gaps:
            return None  # still starting: rendezvous and the first step have their own limits
        return max(self.factor * statistics.median(self._gaps), self.floor_s)

    def stuck_s(self, now: float) -> float | None:
        """Seconds without progress, if that is a hang; else None."""
        limit = self.limit_s()
        if limit is None or self._since is None:
            return None
        idle = now - self._since
        return idle if idle > limit else None
