"""Where the idle GPU-time goes: after each scheduling pass, the healthy GPUs left free, by why.

Allocation cannot rise above the work there is, and the starvation guard trades a little of it
for waits that end. To tell which is which, every pass sorts the free GPUs of healthy nodes:

    nothing queued     free while no request waits: the fleet has more than it is asked for
    reserved           on nodes a reservation holds for a waiting gang
    spare              the spare pool, held back for recovering gangs
    other              free, unreserved, while requests wait: fragments, quotas, GPU types

Each pass's figures hold until the next one; GPUs freed between two passes (a release, a
repair) idle until that next pass and are not in any of these: they are the rest of
1 − allocation.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from workflows.contracts.cluster_models import ClusterState

CAUSES = ("nothing queued", "reserved", "spare", "other")


@dataclass
class IdleLedger:
    """GPU-seconds idle by cause, from `measured_from_s` on (the warm-up is not measured)."""

    measured_from_s: float
    gpu_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(CAUSES, 0.0))
    _since_s: float | None = None
    _free: dict[str, int] = field(default_factory=dict)

    def after_pass(self, state: ClusterState, now_s: float) -> None:
        self.until(now_s)
        reserved = {node_id for r in state.reservations for node_id in r.nodes}
        free = dict.fromkeys(CAUSES, 0)
        waiting = bool(state.queue)
        for node in state.nodes:
            gpus = node.free  # a sum over the node's jobs: once
            if gpus <= 0 or not node.schedulable:
                continue
            if node.spare:
                cause = "spare"
            elif node.info.node_id in reserved:
                cause = "reserved"
            else:
                cause = "other" if waiting else "nothing queued"
            free[cause] += gpus
        self._since_s, self._free = now_s, free

    def until(self, now_s: float) -> None:
        """Charge the last pass's free GPUs up to `now_s` (a pass, or the horizon)."""
        if self._since_s is None:
            return
        span = now_s - max(self._since_s, self.measured_from_s)
        if span > 0:
            for cause, gpus in self._free.items():
                self.gpu_s[cause] += gpus * span
        self._since_s = now_s
