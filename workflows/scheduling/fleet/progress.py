"""One attempt of a job, as arithmetic: restart, then periods of training, each ending in a save.

An attempt granted at `granted` spends `restart` s starting (spawn, rendezvous, load the last
checkpoint), then trains in periods of `plan.period` seconds, each followed by a save. A save
stalls training for its stall, then finishes in the background (the upload) and commits `lag`
seconds later; a save that blocks for its whole duration is the special case of no lag. With a
peer tier, most saves are cheap peer copies and every `store_every`-th goes to the store; the
last save of a job always goes to the store. A failure keeps what the newest committed save of
either tier holds (a peer copy lives on another node, in another failure domain, so one node's
death does not take it); a preemption notice makes the run save to the store at once, keeping
everything done so far if that save commits within the grace period. A shrunk (elastic) gang
does `rate` of the full gang's work per second of training. Times are seconds since the
simulation started; work is in seconds of the full gang's compute.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from workflows.scheduling.fleet.config import Recovery

IntervalRule = Callable[[float, float], float]  # (save stall s, gang MTBF s) -> interval s


@dataclass(frozen=True)
class SavePlan:
    """When a run saves, and what each save costs."""

    period: float  # seconds of training between two saves
    store_stall: float  # a store save's stall of the training loop
    store_lag: float = 0.0  # and how long after the stall its manifest commits
    peer_stall: float = 0.0
    peer_lag: float = 0.0
    store_every: int = 1  # every n-th save goes to the store; 1: no peer tier

    def is_store(self, save: int, last: int) -> bool:
        return save % self.store_every == 0 or save == last

    def stalls(self, saves: int, last: int) -> float:
        """The stall of saves 1 … `saves` of an attempt whose final save is number `last`."""
        store = saves // self.store_every + (1 if saves == last and last % self.store_every else 0)
        return store * self.store_stall + (saves - store) * self.peer_stall

    def lag(self, save: int, last: int) -> float:
        return self.store_lag if self.is_store(save, last) else self.peer_lag


def save_plan(save_s: float, mtbf_s: float, recovery: Recovery, rule: IntervalRule) -> SavePlan:
    """A job's saves under `recovery`: the interval of the cheapest tier is the rule's for that
    tier's stall (Young/Daly, as `checkpoint_every = "auto"`), and at least one save's
    background part long, as the trainer keeps one save of a tier in flight."""
    store_stall = save_s * recovery.async_stall
    store_lag = save_s - store_stall
    if recovery.store_every == 1:
        return SavePlan(max(rule(store_stall, mtbf_s), store_lag, 1.0), store_stall, store_lag)
    peer_stall = store_stall * recovery.peer_stall
    peer_lag = save_s * recovery.peer_lag
    period = max(rule(peer_stall, mtbf_s), peer_lag, 1.0)
    store_every = max(recovery.store_every, math.ceil(store_lag / period))
    return SavePlan(period, store_stall, store_lag, peer_stall, peer_lag, store_every)


@dataclass(frozen=True)
class Attempt:
    granted: float
    restart: float
    plan: SavePlan
    remaining: float  # work left when granted, in seconds of the full gang's compute
    rate: float = 1.0  # work per second of training: a shrunk gang's share of the full one

    @property
    def work_start(self) -> float:
        return self.granted + self.restart

    @property
    def _training(self) -> float:
        """Seconds of training this attempt needs to finish the job."""
        return self.remaining / self.rate

    @property
    def _last(self) -> int:
        """The number of the final save (the one that ends the job)."""
        return max(1, math.ceil(self._training / self.plan.period))

    def _trained_at(self, save: int) -> float:
        return min(save * self.plan.period, self._training)

    def _stall_end(self, save: int) -> float:
        """When save number `save` stops stalling training (0: when training starts)."""
        return self.work_start + self._trained_at(save) + self.plan.stalls(save, self._last)

    def _before(self, t: float) -> int:
        """The newest save whose stall ended by `t` (0 if none)."""
        save = min(self._last, max(0, math.floor((t - self.work_start) / self.plan.period)))
        while save > 0 and self._stall_end(save) > t:
            save -= 1
        return save

    @property
    def end(self) -> float:
        """When the job is done: its final save committed to the store."""
        return self._stall_end(self._last) + self.plan.store_lag

    def last_commit(self, t: float) -> tuple[float, float] | None:
        """(commit time, work it holds) of the newest save committed by `t`, if any."""
        if t >= self.end:
            return self.end, self.remaining
        save = self._before(t)
        while save > 0:
            committed_at = self._stall_end(save) + self.plan.lag(save, self._last)
            if committed_at <= t:
                return committed_at, self._trained_at(save) * self.rate
            save -= 1
        return None

    def committed(self, t: float) -> float:
        """Work held by the newest save committed by `t`: what a failure at `t` keeps."""
        last = self.last_commit(t)
        return last[1] if last is not None else 0.0

    def done(self, t: float) -> float:
        """Work done by `t`, saved or not: what a save started at `t` keeps."""
        if t >= self.end:
            return self.remaining
        save = self._before(t)
        since = max(0.0, t - self._stall_end(save))
        trained = min(self._trained_at(save) + min(since, self.plan.period), self._training)
        return trained * self.rate

    def wall(self, work: float) -> float:
        """Seconds from the work's start that `work` of it takes, saves included."""
        training = work / self.rate
        saves = min(self._last, math.floor(training / self.plan.period))
        return training + self.plan.stalls(saves, self._last)

    def preempted(self, notice: float, grace: float) -> tuple[float, float]:
        """(release time, work kept) for a notice at `notice`: save to the store now if that
        save commits within the grace period, else whatever was committed when it runs out."""
        if notice < self.work_start:  # still starting: nothing to save
            return notice, 0.0
        save = self.plan.store_stall + self.plan.store_lag
        if save <= grace:
            return notice + save, self.done(notice)
        return notice + grace, self.committed(notice + grace)
