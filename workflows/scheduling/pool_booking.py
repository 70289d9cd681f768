"""Where a request fits among the scheduling pass's pools, and booking what it was given.

A pass splits the schedulable nodes into pools: the general one, the spares, what is claimed for
a run, and one per reservation (split off the general pool). A request may fit in several (its
own claim and kept reservation beside the general pool, a reservation it ends before, the
spares when it recovers, a reservation it may only yield on); `find_place` tries them in that
order, and `take` books the nodes in the pool they came from.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime

from workflows.contracts.cluster_models import GangRequest, Reservation
from workflows.scheduling.backfill import fits_before
from workflows.scheduling.placement import Capacity, place
from workflows.scheduling.yielding import latest_first, may_yield


def without(pools: list[Capacity], node_ids: set[str]) -> Capacity:
    """The pools' nodes but `node_ids`. Not `split`: a node split off stays behind with no
    free GPU, and the running gangs that `reserve` and `choose_victims` give back would free
    it again, so a second reservation or a reclaim could take a reserved node."""
    return Capacity(
        (
            (pool.info[i], free)
            for pool in pools
            for i, free in pool.free.items()
            if i not in node_ids
        ),
        pools[0].levels if pools else (),
    )


def merged(pools: list[Capacity]) -> Capacity:
    """One view of several pools' nodes (disjoint sets of nodes)."""
    view = pools[0]
    for pool in pools[1:]:
        view = view.merged(pool)
    return view


def exact_size(pool: Capacity, gpus: int) -> Capacity:
    return Capacity(
        ((pool.info[i], free) for i, free in pool.free.items() if pool.info[i].gpus == gpus),
        pool.levels,
    )


def per_node(request: GangRequest, pool: Capacity, node_id: str) -> int:
    """A multi-node gang books its nodes whole; a single-node job what it asked for."""
    return pool.info[node_id].gpus if request.nodes > 1 else request.gpus_per_node


def held_gpus(request: GangRequest, pools: list[Capacity], placed: list[str]) -> int:
    return sum(
        per_node(request, next(p for p in pools if node_id in p.free), node_id)
        for node_id in placed
    )


def take(request: GangRequest, pools: list[Capacity], placed: list[str], where_free: bool) -> None:
    """Book the placed nodes in the pools they came from. A node split off into a reservation
    stays in the general pool with nothing free: taken from there (the first pool holding it,
    as before `where_free`), it stayed free in the reservation's pool, and a backfill on that
    reservation was put on a node its owner had just been granted (seen in the three-week
    simulation, with and without yielders). `where_free` takes it where its GPUs are free."""
    for node_id in placed:
        holding = [p for p in pools if node_id in p.free]
        pool = max(holding, key=lambda p: p.free[node_id]) if where_free else holding[0]
        pool.take(node_id, per_node(request, pool, node_id))


def find_place(
    request: GangRequest,
    general: Capacity,
    own: list[Capacity],
    reservations: list[tuple[Reservation, Capacity]],
    spares: Capacity,
    now: datetime,
    default_runtime_s: float,
    hosts_yielders: Callable[[Reservation], bool],
    yield_latest_first: bool = False,
) -> tuple[list[str], list[Capacity], str | None] | None:
    """Where the request fits, the pools its nodes come from (nothing is booked yet), and whose
    reservation it yields to if it fits only as a yielder (`yielding`): `own` holds
    what is held for it alone (nodes it claimed, its kept reservation). `yield_latest_first`
    tries the reservations that start latest first for a yielder (`yielding.latest_first`)."""
    options: list[tuple[list[Capacity], str | None]] = [([general, *own], None)]
    for reservation, reserved in reservations:
        if fits_before(request, reservation, now, default_runtime_s):
            options.append(([reserved], None))
    if request.recovery and spares.free:
        # A gang recovering from a failure may swap spares in beside ordinary free nodes.
        options.append(([general, *own, spares], None))
    lendable = latest_first(reservations) if yield_latest_first else reservations
    options += [
        ([reserved], reservation.run_id)
        for reservation, reserved in lendable
        if reserved.total_free(request.gpu_type) >= request.gpus
        and may_yield(request, reservation)
        and hosts_yielders(reservation)
    ]
    for pools, yields_to in options:
        placed = place(request, merged(pools))
        if placed is not None:
            return placed, pools, yields_to
    return None
