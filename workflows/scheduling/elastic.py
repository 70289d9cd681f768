"""Elastic gangs: a run with `resources.min_nodes` survives a failure that leaves no node to
replace the lost one by training on fewer nodes, and grows back when capacity returns.

Shrinking happens only after a failure (a recovering request): a run that is simply queued
waits for its whole gang as before, so elasticity never lets a big run take a small share of
the cluster ahead of others. Growing back is a stop at a checkpoint, like a preemption with a
grace period, except that the nodes the full gang needs are claimed for the run first, so
nothing else takes them while it checkpoints.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from typing import TypeVar

from workflows.contracts.cluster_models import (
    Allocation,
    Claim,
    ClusterConfig,
    ClusterState,
    GangRequest,
)
from workflows.scheduling.placement import Capacity, place
from workflows.scheduling.quotas import check

Found = TypeVar("Found")


def _sizes(request: GangRequest) -> Iterator[GangRequest]:
    """The request, then (recovering and elastic) the same one on fewer nodes, down to
    `min_nodes`: the largest gang that fits wins."""
    yield request
    if request.recovery and request.min_nodes is not None:
        for nodes in range(request.nodes - 1, request.min_nodes - 1, -1):
            yield request.model_copy(update={"nodes": nodes})


def largest_fit(
    request: GangRequest, fit: Callable[[GangRequest], Found | None]
) -> tuple[GangRequest, Found | None]:
    """The largest size of `request` that `fit` places, and where; (request, None) if none."""
    for size in _sizes(request):
        found = fit(size)
        if found is not None:
            return size, found
    return request, None


def claim_holders(state: ClusterState) -> set[str]:
    """Runs whose claims hold: queued ones, and those whose shrunk gang is stopping to grow
    back (between the grow notice and its release the run is not queued, and the nodes it
    will grow onto must not go to someone else)."""
    growing = {
        a.run_id for a in state.allocations if a.preempting and a.preempting.grow_to is not None
    }
    return {r.run_id for r in state.queue} | growing


def _with_own_nodes(general: Capacity, allocation: Allocation) -> Capacity:
    """The free capacity as it would be if `allocation` gave its nodes back."""
    view = general.copy()
    for info in allocation.nodes:
        if info.node_id in view.info:
            view.give(info.node_id, allocation.held_on(info))
        else:
            view.add(info, allocation.held_on(info))
    return view


def grow_back(
    config: ClusterConfig,
    allocations: list[Allocation],
    general: Capacity,
    used: dict[str, int],
    excluded: set[str],
    now: datetime,
) -> list[tuple[Allocation, list[str]]]:
    """Shrunk gangs that can have their full size again from what the queue left free (spares
    are not used: they are for recoveries), with the nodes each would get. Their targets leave
    `general`, so two gangs never count on the same free node."""
    grown: list[tuple[Allocation, list[str]]] = []
    for allocation in allocations:
        wanted = allocation.wanted
        if wanted is None or allocation.preempting is not None or allocation.run_id in excluded:
            continue
        target = place(wanted, _with_own_nodes(general, allocation))
        if target is None:
            continue
        extra = wanted.gpus - allocation.gpus  # what the team's quota must still allow
        if not check(config, used, wanted, max(0, extra)).allowed:
            continue
        general.split([i for i in target if i in general.free])
        grown.append((allocation, target))
    return grown


def grow_claim(run_id: str, target: list[str], deadline: datetime, grace_s: float) -> Claim:
    """The target nodes, held for the run until a grace period after its own deadline."""
    return Claim(run_id=run_id, nodes=target, until=deadline + timedelta(seconds=grace_s))
