"""Backfill with a reservation (EASY backfill): the head of the line never starves.

The first request that cannot start gets a reservation: the nodes that free soonest (by the
running gangs' expected ends) until it fits, and the time they free. A later, smaller request
may still start on those nodes, but only if its max runtime ends before the reservation does.
Since every gang has a bounded runtime, the reserved nodes are free by the reservation's start.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from workflows.contracts.cluster_models import Allocation, GangRequest, Reservation
from workflows.scheduling.placement import Capacity, place
from workflows.scheduling.preemption import give_back


def runtime(request: GangRequest, default_s: float) -> timedelta:
    return timedelta(seconds=request.max_runtime_s or default_s)


def reserve(
    request: GangRequest, capacity: Capacity, allocations: list[Allocation], now: datetime
) -> Reservation | None:
    """Where and when `request` will fit if nothing else starts; None if it never can."""
    future = capacity.copy()
    gpus = request.gpus
    placed = place(request, future)
    if placed is not None:  # it fits now; only something else (a quota, a claim) holds it back
        return Reservation(run_id=request.run_id, nodes=placed, start=now)
    for allocation in sorted(allocations, key=lambda a: (a.expected_end or datetime.max, a.run_id)):
        give_back(future, allocation)
        if future.total_free(request.gpu_type) < gpus or not _enough_whole(request, future):
            continue  # cheaper than a placement attempt that cannot succeed
        placed = place(request, future)
        if placed is not None:
            start = max(now, allocation.expected_end or now)
            return Reservation(run_id=request.run_id, nodes=placed, start=start)
    return None


def _enough_whole(request: GangRequest, capacity: Capacity) -> bool:
    """A gang takes whole idle nodes: with fewer of them than it asks for, `place` must fail
    (a long-waiting gang is reserved for every pass, at a placement attempt per running gang)."""
    if request.nodes == 1:
        return True
    whole = sum(
        len(ids)
        for (gpu_type, _), ids in capacity.whole.items()
        if request.gpu_type in (None, gpu_type)
    )
    return whole >= request.nodes


def fits_before(
    request: GangRequest, reservation: Reservation, now: datetime, default_s: float
) -> bool:
    return now + runtime(request, default_s) <= reservation.start
