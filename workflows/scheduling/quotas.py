"""Team quotas and fair share over the queue tree (org → team).

A team can always reach its guaranteed GPUs (by reclaiming what others borrowed); above its
guarantee it may borrow idle capacity up to its ceiling (and every ancestor's), with preemptible
jobs only. Which of a team's allocations are "borrowed" is decided by age: the oldest ones fill
the guarantee, the rest are borrowed and may be preempted to give a guarantee back.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime

from workflows.contracts.cluster_models import Allocation, ClusterConfig, GangRequest


def in_use(config: ClusterConfig, allocations: list[Allocation]) -> dict[str, int]:
    """GPUs held per queue, counting a team's GPUs in every ancestor too."""
    used: dict[str, int] = defaultdict(int)
    for allocation in allocations:
        for queue in config.ancestry(allocation.team):
            used[queue.name] += allocation.gpus
    return used


@dataclass(frozen=True)
class QuotaCheck:
    allowed: bool
    borrowing: bool  # the grant would go beyond the team's guarantee
    reason: str = ""


def check(
    config: ClusterConfig, used: dict[str, int], request: GangRequest, gpus: int | None = None
) -> QuotaCheck:
    """Against what the request asks for, or (`gpus`) what a placement would actually hold."""
    gpus = request.gpus if gpus is None else gpus
    for queue in config.ancestry(request.team):
        if queue.max_gpus is not None and used.get(queue.name, 0) + gpus > queue.max_gpus:
            return QuotaCheck(
                False,
                True,
                f"queue {queue.name} is at its ceiling: {used.get(queue.name, 0)} in use + "
                f"{gpus} requested > max_gpus {queue.max_gpus}",
            )
    team = config.queue(request.team)
    borrowing = used.get(team.name, 0) + gpus > team.guaranteed_gpus
    if borrowing and not request.preemptible:
        return QuotaCheck(
            False,
            True,
            f"beyond team {team.name}'s guarantee of {team.guaranteed_gpus} GPUs only "
            "preemptible jobs may borrow (set resources.preemptible = true)",
        )
    return QuotaCheck(True, borrowing)


def borrowed(config: ClusterConfig, allocations: list[Allocation]) -> set[str]:
    """Runs whose GPUs lie beyond their team's guarantee. The team's most important gangs fill
    it first, then the oldest: otherwise a big high-priority run that restarts (after a failure
    or a preemption) becomes the newest grant, so the borrower, so the next victim, and thrashes
    (seen in simulation: a 4,096-GPU run preempted 110 times in three weeks)."""
    by_team: dict[str, list[Allocation]] = defaultdict(list)
    for allocation in allocations:
        by_team[allocation.team].append(allocation)
    result = set()
    for team, held in by_team.items():
        room = config.queue(team).guaranteed_gpus
        for allocation in sorted(
            held, key=lambda a: (-a.priority, a.granted_at or datetime.min, a.run_id)
        ):
            if allocation.gpus <= room:
                room -= allocation.gpus
            else:
                result.add(allocation.run_id)
    return result


def decay_usage(
    usage: dict[str, float],
    since: datetime | None,
    now: datetime,
    half_life_s: float,
    allocations: list[Allocation],
) -> dict[str, float]:
    """GPU-seconds per team, halving every `half_life_s`: recent use weighs most."""
    elapsed = max(0.0, (now - since).total_seconds()) if since else 0.0
    factor = 0.5 ** (elapsed / half_life_s)
    decayed = {team: value * factor for team, value in usage.items() if value * factor > 1e-6}
    for allocation in allocations:
        decayed[allocation.team] = decayed.get(allocation.team, 0.0) + allocation.gpus * elapsed
    return decayed


def fair_share_key(config: ClusterConfig, usage: dict[str, float], team: str) -> float:
    """Lower goes first: usage relative to what the team is guaranteed."""
    return usage.get(team, 0.0) / max(1, config.queue(team).guaranteed_gpus)
