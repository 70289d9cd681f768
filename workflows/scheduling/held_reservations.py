"""Reservations that hold (the starvation guard of `scheduler`): a request waiting
past `reserve_after_s` keeps its reservation on the same nodes from pass to pass, a gang past
its max runtime on those nodes is stopped, and a request that never ran starts by
`start_within_s` after its submission (the start deadline).

The deadline's reservation starts no later than that (backfill on its nodes must end by then),
and at that time the gangs still on its nodes are preempted unless they outrank it or are not
preemptible.
A run requeued after it ran keeps its age (its reservation at once) and gets a deadline of its
own, `start_within_s` after it was requeued (`GangRequest.waiting_since`). Not the deadline of
its first submission: a victim would evict whatever held its nodes at once, and in simulation
one deadline's victims evicted the next (14,645 preemptions in three weeks). And not none: a
4,096-GPU run that failed then waited 30.9 h in simulation for its nodes to come back.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from workflows.contracts.cluster_models import (
    ClusterConfig,
    ClusterState,
    GangRequest,
    Preemption,
    Reservation,
)
from workflows.scheduling.placement import Capacity, place
from workflows.scheduling.yielding import planned_without_yielders, yielders_due


def _start_by(request: GangRequest, config: ClusterConfig) -> datetime | None:
    # A requeued run's wait began at its requeue (None in histories from before: no deadline).
    waiting_since = request.waiting_since if request.started_before else request.submitted_at
    if waiting_since is None:
        return None
    return waiting_since + timedelta(seconds=config.start_within_s)


def held_by_deadline(
    reservation: Reservation, request: GangRequest, config: ClusterConfig, now: datetime
) -> Reservation:
    """A reservation starts by the request's deadline, not when the declared max runtimes of
    the gangs on its nodes would let it: backfill onto its nodes must end by then too."""
    start_by = _start_by(request, config)
    if start_by is None or reservation.start <= start_by:
        return reservation
    return reservation.model_copy(update={"start": max(now, start_by)})


def _duration(span: timedelta) -> str:
    seconds = span.total_seconds()
    return f"{seconds // 3600:.0f} h" if seconds >= 3600 else f"{seconds // 60:.0f} min"


def _due(
    state: ClusterState,
    reservation: Reservation,
    request: GangRequest,
    now: datetime,
    excluded: set[str],
) -> list[tuple[str, Preemption]]:
    """At a long-waiting request's deadline the gangs still on its reserved nodes give them
    back (after their grace, with a checkpoint), unless they outrank it: waiting is then no
    longer a matter of when they happen to end."""
    start_by = _start_by(request, state.config)
    if start_by is None or now < start_by:
        return []
    nodes = set(reservation.nodes)
    deadline = now + timedelta(seconds=state.config.preemption_grace_s)
    waited = now - start_by + timedelta(seconds=state.config.start_within_s)
    reason = f"holds nodes reserved for {request.run_id}, waiting {_duration(waited)}"
    return [
        (a.run_id, Preemption(for_run=request.run_id, reason=reason, deadline=deadline))
        for a in state.allocations
        if a.preempting is None
        and a.preemptible
        and a.run_id not in excluded
        and a.priority <= request.priority
        and nodes & {n.node_id for n in a.nodes}
    ]


def keep_reservations(
    state: ClusterState,
    general: Capacity,
    requests: dict[str, GangRequest],
    now: datetime,
    deadline: bool,
) -> list[tuple[Reservation, Capacity]]:
    """Last pass's reservations of requests still queued and waiting past `reserve_after_s`
    whose nodes are all still schedulable and in the general pool (not down, drained, claimed
    or spare) and hold the request once free: their nodes leave `general`, their start is when
    those nodes free (by the expected ends, as `reserve` estimates it). A younger request's
    reservation is remade as before: an older one (a gang recovering its survivors) goes first."""
    kept: list[tuple[Reservation, Capacity]] = []
    taken: set[str] = set()
    for old in state.reservations:
        nodes = set(old.nodes)
        if old.run_id not in requests or nodes & taken or not nodes <= general.free.keys():
            continue
        if not long_waiting(requests[old.run_id], now, state.config):
            continue
        whole = Capacity(
            ((general.info[i], general.info[i].gpus) for i in old.nodes), general.levels
        )
        if place(requests[old.run_id], whole) is None:
            continue  # it asks for something else now (another size or GPU type)
        ends = [
            a.expected_end or now
            for a in state.allocations
            if any(n.node_id in nodes for n in a.nodes)
            and not planned_without_yielders(a, old.run_id)
        ]
        reservation = Reservation(run_id=old.run_id, nodes=old.nodes, start=max([now, *ends]))
        if deadline:
            reservation = held_by_deadline(reservation, requests[old.run_id], state.config, now)
        kept.append((reservation, general.split(old.nodes)))
        taken |= nodes
    return kept


def long_waiting(request: GangRequest, now: datetime, config: ClusterConfig) -> bool:
    """Waited long enough that aging alone will not save it: it gets its own reservation."""
    if request.submitted_at is None:
        return False
    return (now - request.submitted_at).total_seconds() >= config.reserve_after_s


def clearing(
    state: ClusterState,
    reservation: Reservation,
    request: GangRequest,
    now: datetime,
    excluded: set[str],
    deadline: bool,
    yielding: bool = False,
) -> list[tuple[str, Preemption]]:
    """Who leaves a reservation's nodes now: gangs past their max runtime, at a first start's
    deadline (which acts only past `reserve_after_s`) the gangs it does not outrank, and, as
    it is about to start, the gangs that took its nodes as yielders (`yielding`).
    One notice per gang: an overdue gang is not told twice."""
    stopped = _overdue(state, reservation, now, excluded)
    if deadline:
        told = excluded | {victim for victim, _ in stopped}
        stopped += _due(state, reservation, request, now, told)
    if yielding:
        told = excluded | {victim for victim, _ in stopped}
        stopped += yielders_due(state, reservation, now, told)
    return stopped


def _overdue(
    state: ClusterState, reservation: Reservation, now: datetime, excluded: set[str]
) -> list[tuple[str, Preemption]]:
    """A gang past its max runtime on reserved nodes is stopped: reservations rely on it."""
    nodes = set(reservation.nodes)
    deadline = now + timedelta(seconds=state.config.preemption_grace_s)
    return [
        (
            a.run_id,
            Preemption(
                for_run=reservation.run_id, reason="exceeded its max runtime", deadline=deadline
            ),
        )
        for a in state.allocations
        if a.preempting is None
        and a.run_id not in excluded
        and a.expected_end is not None
        and a.expected_end < now
        and nodes & {n.node_id for n in a.nodes}
    ]
