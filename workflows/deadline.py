"""The start deadline: a request that has waited past `reserve_after_s` and never ran starts
by `start_within_s` after its submission (`workflows.scheduler`, with the starvation guard).

Its reservation starts no later than that (backfill on its nodes must end by then), and at that
time the gangs still on its nodes are preempted unless they outrank it or are not preemptible.
A run requeued after it ran keeps its age but not a deadline: given the deadline of its first
submission, a victim would evict whatever held its nodes at once, and in simulation one
deadline's victims evicted the next (14,645 preemptions in three weeks).
"""

from __future__ import annotations

from datetime import datetime, timedelta

from workflows.cluster_models import (
    ClusterConfig,
    ClusterState,
    GangRequest,
    Preemption,
    Reservation,
)


def _start_by(request: GangRequest, config: ClusterConfig) -> datetime | None:
    if request.submitted_at is None or request.started_before:
        return None
    return request.submitted_at + timedelta(seconds=config.start_within_s)


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


def due(
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
