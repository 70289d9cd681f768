"""One scheduling pass: a pure function from the cluster state to decisions.

Order: effective priority (priority plus one level per `aging_s` waited, so nothing waits
forever), then fair share (decayed usage over guarantee), then age. For each request in order:
quota check, placement (outside the head-of-line reservation, or inside it if the request ends
before the reservation starts), else reclaim the team's guarantee by preemption, else the first
such request becomes the head of the line and gets a reservation. Spare nodes are held back for
recovery requests. The `Cluster` workflow applies the decisions; nothing here mutates its input.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta

from workflows.backfill import fits_before, reserve, runtime
from workflows.cluster_models import (
    Admin,
    ClusterState,
    GangRequest,
    Node,
    Preemption,
    Reservation,
    Waiting,
)
from workflows.placement import Capacity, place
from workflows.preemption import choose_victims
from workflows.quotas import borrowed, check, fair_share_key, in_use


@dataclass
class Decisions:
    grants: list[tuple[GangRequest, list[str]]] = field(default_factory=list)
    preemptions: list[tuple[str, Preemption]] = field(default_factory=list)
    reservation: Reservation | None = None
    waiting: list[Waiting] = field(default_factory=list)
    spares: set[str] = field(default_factory=set)


def effective_priority(request: GangRequest, now: datetime, aging_s: float) -> float:
    waited = (now - request.submitted_at).total_seconds() if request.submitted_at else 0.0
    return request.priority + max(0.0, waited) // aging_s


def order(state: ClusterState, now: datetime) -> list[GangRequest]:
    config = state.config
    return sorted(
        state.queue,
        key=lambda r: (
            -effective_priority(r, now, config.aging_s),
            fair_share_key(config, state.usage, r.team),
            r.submitted_at or now,
            r.run_id,
        ),
    )


def choose_spares(nodes: list[Node], count: int) -> set[str]:
    """Keep `count` healthy, idle, active nodes back; current spares stay spares if they can."""
    eligible = [n for n in nodes if n.schedulable and not n.jobs]
    keep = sorted(n.info.node_id for n in eligible if n.spare)[:count]
    others = sorted((n.info.node_id for n in eligible if not n.spare), reverse=True)
    return set(keep + others[: count - len(keep)])


def _capacity(nodes: list[Node], include: set[str] | None = None, exclude: set[str] = frozenset()):
    return Capacity(
        (n.info, n.free)
        for n in nodes
        if n.schedulable
        and n.info.node_id not in exclude
        and (include is None or n.info.node_id in include)
    )


def schedule(state: ClusterState, now: datetime) -> Decisions:
    config = state.config
    default_runtime_s = config.default_max_runtime_h * 3600
    decisions = Decisions(spares=choose_spares(state.nodes, config.spare_nodes))
    general = _capacity(state.nodes, exclude=decisions.spares)
    spare_capacity = _capacity(state.nodes, include=decisions.spares)
    used = in_use(config, state.allocations)
    lenders = borrowed(config, state.allocations)
    running = [a for a in state.allocations if a.preempting is None]
    being_preempted = {a.run_id for a in state.allocations if a.preempting}
    reclaiming = {a.preempting.for_run for a in state.allocations if a.preempting}
    reserved = Capacity(())
    reservation: Reservation | None = None

    decisions.preemptions += _drain_preemptions(state, now)
    being_preempted |= {victim for victim, _ in decisions.preemptions}

    for position, request in enumerate(order(state, now)):
        quota = check(config, used, request)
        if not quota.allowed:
            decisions.waiting.append(
                Waiting(run_id=request.run_id, position=position, reason=quota.reason)
            )
            continue
        if request.run_id in reclaiming:
            decisions.waiting.append(
                Waiting(
                    run_id=request.run_id,
                    position=position,
                    reason="reclaiming its team's guarantee: waiting for the preempted gang to "
                    "checkpoint and release",
                )
            )
            continue
        placed = _place_and_take(
            request, general, reserved, spare_capacity, reservation, now, default_runtime_s
        )
        if placed is not None:
            decisions.grants.append((request, placed))
            for queue in config.ancestry(request.team):
                used[queue.name] = used.get(queue.name, 0) + request.gpus
            decisions.spares -= set(placed)
            continue
        if not quota.borrowing:
            victims = choose_victims(
                request,
                general,
                [a for a in running if a.run_id not in being_preempted],
                lenders,
                now,
            )
            if victims:
                deadline = now + timedelta(seconds=config.preemption_grace_s)
                for victim in victims:
                    notice = Preemption(
                        for_run=request.run_id,
                        reason=f"{request.run_id} (team {request.team}) reclaims its guarantee",
                        deadline=deadline,
                    )
                    decisions.preemptions.append((victim.run_id, notice))
                    being_preempted.add(victim.run_id)
                names = ", ".join(v.run_id for v in victims)
                decisions.waiting.append(
                    Waiting(
                        run_id=request.run_id,
                        position=position,
                        reason=f"reclaiming its team's guarantee: preempting {names}",
                    )
                )
                continue
        if reservation is None:
            reservation = reserve(request, general, running, now)
            if reservation is None:
                decisions.waiting.append(
                    Waiting(
                        run_id=request.run_id,
                        position=position,
                        reason=f"needs {request.nodes} node(s) × {request.gpus_per_node} GPU(s)"
                        + (f" of type {request.gpu_type}" if request.gpu_type else "")
                        + ": more than the cluster's schedulable nodes can ever give",
                    )
                )
                continue
            # The reserved nodes leave the general pool: only short jobs may borrow them.
            reserved = general.split(reservation.nodes)
            decisions.reservation = reservation
            decisions.preemptions += _overdue(state, reservation, now, being_preempted)
            decisions.waiting.append(
                Waiting(
                    run_id=request.run_id,
                    position=position,
                    reason=f"head of the line: {len(reservation.nodes)} node(s) reserved from "
                    f"{reservation.start:%Y-%m-%d %H:%M:%S} UTC",
                )
            )
            continue
        decisions.waiting.append(
            Waiting(
                run_id=request.run_id,
                position=position,
                reason=f"no capacity: behind {reservation.run_id}'s reservation",
            )
        )
    return decisions


def _take(request: GangRequest, pools: list[Capacity], placed: list[str]) -> list[str]:
    """Book the placed nodes in whichever pool holds each: whole nodes for a multi-node gang."""
    for node_id in placed:
        pool = next(p for p in pools if node_id in p.free)
        pool.take(node_id, pool.free[node_id] if request.nodes > 1 else request.gpus_per_node)
    return placed


def _place_and_take(
    request: GangRequest,
    general: Capacity,
    reserved: Capacity,
    spares: Capacity,
    reservation: Reservation | None,
    now: datetime,
    default_runtime_s: float,
) -> list[str] | None:
    placed = place(request, general)
    if placed is not None:
        return _take(request, [general], placed)
    if reservation is not None and fits_before(request, reservation, now, default_runtime_s):
        placed = place(request, reserved)
        if placed is not None:
            return _take(request, [reserved], placed)
    if request.recovery and spares.free:
        # A gang recovering from a failure may swap spares in beside ordinary free nodes.
        placed = place(request, general.merged(spares))
        if placed is not None:
            return _take(request, [general, spares], placed)
    return None


def _drain_preemptions(state: ClusterState, now: datetime) -> list[tuple[str, Preemption]]:
    """A draining node gives back what it runs: its gangs checkpoint and move elsewhere."""
    draining = {n.info.node_id for n in state.nodes if n.admin == Admin.DRAINING and n.jobs}
    deadline = now + timedelta(seconds=state.config.preemption_grace_s)
    return [
        (a.run_id, Preemption(for_run="", reason=f"node {node} is draining", deadline=deadline))
        for a in state.allocations
        if a.preempting is None
        for node in sorted({n.node_id for n in a.nodes} & draining)[:1]
    ]


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


def expected_end(request: GangRequest, granted_at: datetime, default_runtime_s: float) -> datetime:
    return granted_at + runtime(request, default_runtime_s)
