"""How fast a gang steps, from its progress lines: what an ETA divides the steps left by."""

from __future__ import annotations

from collections import deque


class StepRate:
    """Steps per second over the newest `window` step lines (one each `log_every` steps), by
    the times the ranks wrote on them (not when the agent read them: it reads in batches).
    Checkpoint saves and evaluations inside the window count, as they will in the steps left."""

    def __init__(self, window: int = 20) -> None:
        self._seen: deque[tuple[int, float]] = deque(maxlen=window)

    def add(self, step: int, at: float) -> None:
        if self._seen and step <= self._seen[-1][0]:
            self._seen.clear()  # a new attempt resumed from an earlier step: its own rate
        self._seen.append((step, at))

    @property
    def per_s(self) -> float | None:
        if len(self._seen) < 2:
            return None
        (first_step, first_at), (last_step, last_at) = self._seen[0], self._seen[-1]
        return (last_step - first_step) / (last_at - first_at) if last_at > first_at else None
