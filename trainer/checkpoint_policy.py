"""When to checkpoint: every N steps, every M minutes, at each new epoch, or `auto`.

`auto` is the Young/Daly optimum: with a checkpoint costing C seconds of blocked training and
failures arriving every M seconds on average, the interval that loses least is about
√(2·C·M) − C (Daly's first-order correction of Young's √(2·C·M)). C is measured on every save
(the loop's stall), so the interval follows what saves really cost; it is never shorter than the
last save took to commit, since only one save is in flight.

Time-based decisions are made by rank 0 alone and shared with the step's all-gather, so every
rank saves at the same step whatever its clock says.
"""

from __future__ import annotations

from dataclasses import dataclass

from infra.capacity_plan import daly_interval_s

# auto: the first save comes at once, to measure what a save costs on this gang.
FIRST_AUTO_SAVE_S = 0.0


def young_daly_interval_s(cost_s: float, mtbf_s: float) -> float:
    """The checkpoint interval that loses least work + checkpoint time to failures."""
    if cost_s <= 0:
        return 0.0
    return daly_interval_s(cost_s, mtbf_s)  # the planner's rule (infra.capacity_plan)


@dataclass(frozen=True)
class CheckpointPolicy:
    every_steps: int | None = None
    every_s: float | None = None
    each_epoch: bool = False
    auto_mtbf_s: float | None = None  # set: choose the interval by Young/Daly

    @classmethod
    def from_train_config(cls, cfg: dict, mtbf_s: float) -> CheckpointPolicy:
        every = cfg["checkpoint_every"]
        minutes = cfg.get("checkpoint_every_minutes")
        return cls(
            every_steps=every if isinstance(every, int) else None,
            every_s=minutes * 60 if minutes else None,
            each_epoch=cfg.get("checkpoint_each_epoch", False),
            auto_mtbf_s=mtbf_s if every == "auto" else None,
        )

    def interval_s(self, stall_s: float | None, commit_s: float | None) -> float | None:
        """The time-based interval now in force (the shorter of minutes and auto), if any."""
        candidates = [self.every_s] if self.every_s else []
        if self.auto_mtbf_s is not None:
            if stall_s is None:
                candidates.append(FIRST_AUTO_SAVE_S)
            else:
                optimum = young_daly_interval_s(stall_s, self.auto_mtbf_s)
                candidates.append(max(optimum, commit_s or 0.0))
        return min(candidates) if candidates else None

    def due(
        self,
        step: int,
        since_last_save_s: float,
        epoch_ended: bool,
        stall_s: float | None = None,
        commit_s: float | None = None,
    ) -> bool:
        if self.every_steps and step % self.every_steps == 0:
            return True
        if self.each_epoch and epoch_ended:
            return True
        interval = self.interval_s(stall_s, commit_s)
        return interval is not None and since_last_save_s >= interval
