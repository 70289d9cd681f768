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
    Allocation,
    Claim,
    ClusterConfig,
    ClusterState,
    GangRequest,
    Health,
    Node,
    NodeInfo,
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
    claims: list[Claim] = field(default_factory=list)


def effective_priority(request: GangRequest, now: datetime, aging_s: float) -> float:
    waited = (now - request.submitted_at).total_seconds() if request.submitted_at else 0.0
    return request.priority + max(0.0, waited) // aging_s


def order(state: ClusterState, now: datetime, arrival_order: bool = False) -> list[GangRequest]:
    config = state.config
    if arrival_order:  # strict FIFO, for comparing policies (`forgeline simulate --compare`)
        return sorted(state.queue, key=lambda r: (r.submitted_at or now, r.run_id))
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


@dataclass
class _Sweep:
    """What a pass needs from every node, gathered in one sweep: at 2,500 nodes each sweep
    costs about a millisecond, and a pass used to make five."""

    usable: list[tuple[NodeInfo, int]] = field(default_factory=list)  # schedulable: free GPUs
    idle: list[Node] = field(default_factory=list)  # schedulable and running nothing
    draining: set[str] = field(default_factory=set)  # draining nodes that still run something


def _sweep(nodes: list[Node]) -> _Sweep:
    sweep = _Sweep()
    for n in nodes:
        if n.admin != Admin.ACTIVE:
            if n.admin == Admin.DRAINING and n.jobs:
                sweep.draining.add(n.info.node_id)
            continue
        if n.health != Health.HEALTHY:
            continue
        info, jobs = n.info, n.jobs
        if jobs:
            sweep.usable.append((info, info.gpus - sum(jobs.values())))
        else:
            sweep.usable.append((info, info.gpus))
            sweep.idle.append(n)
    return sweep


def _pools(
    usable: list[tuple[NodeInfo, int]], spares: set[str], owner: dict[str, str]
) -> tuple[Capacity, Capacity, dict[str, Capacity], Capacity]:
    """The schedulable nodes' free GPUs: the general pool (neither spare nor claimed), the spare
    pool, what is held for each claimant, and all that is claimed."""
    general: list[tuple[NodeInfo, int]] = []
    spare: list[tuple[NodeInfo, int]] = []
    claimed: list[tuple[NodeInfo, int]] = []
    for entry in usable:
        node_id = entry[0].node_id
        if node_id in spares:
            spare.append(entry)
        elif node_id in owner:
            claimed.append(entry)
        else:
            general.append(entry)
    held_for: dict[str, Capacity] = {}
    for info, free in claimed:
        held_for.setdefault(owner[info.node_id], Capacity(())).add(info, free)
    return Capacity(general), Capacity(spare), held_for, Capacity(claimed)


def schedule(
    state: ClusterState,
    now: datetime,
    *,
    arrival_order: bool = False,
    backfill: bool = True,
    preemption: bool = True,
) -> Decisions:
    """The switches exist to compare weaker policies in simulation; the cluster uses the
    defaults: `arrival_order` ignores priority and fair share, `backfill=False` starts nothing
    behind the head of the line, `preemption=False` never reclaims a guarantee."""
    config = state.config
    default_runtime_s = config.default_max_runtime_h * 3600
    sweep = _sweep(state.nodes)
    decisions = Decisions(spares=choose_spares(sweep.idle, config.spare_nodes))
    queued = {r.run_id for r in state.queue}
    # Claimed nodes are held for their claimant (the first claim on a node wins).
    owner: dict[str, str] = {}
    for claim in state.claims:
        if claim.until > now and claim.run_id in queued:
            for node_id in claim.nodes:
                if node_id not in decisions.spares:
                    owner.setdefault(node_id, claim.run_id)
    # `all_claimed` grows with this pass's claims.
    general, spare_capacity, held_for, all_claimed = _pools(sweep.usable, decisions.spares, owner)
    used = in_use(config, state.allocations)
    lenders = borrowed(config, state.allocations)
    running = [a for a in state.allocations if a.preempting is None]
    granted_now: list[Allocation] = []  # this pass's grants: they free up too, for `reserve`
    being_preempted = {a.run_id for a in state.allocations if a.preempting}
    reclaiming = {a.preempting.for_run for a in state.allocations if a.preempting}
    reserved = Capacity(())
    reservation: Reservation | None = None

    decisions.preemptions += _drain_preemptions(state, sweep.draining, now)
    being_preempted |= {victim for victim, _ in decisions.preemptions}

    def wait(position: int, request: GangRequest, reason: str) -> None:
        decisions.waiting.append(Waiting(run_id=request.run_id, position=position, reason=reason))

    for position, request in enumerate(order(state, now, arrival_order)):
        quota = check(config, used, request)
        if not quota.allowed:
            wait(position, request, quota.reason)
            continue
        if reservation is not None and not backfill:
            wait(position, request, f"no backfill: behind {reservation.run_id}")
            continue
        if request.run_id in reclaiming:
            wait(
                position,
                request,
                "reclaiming its team's guarantee: waiting for the preempted gang to checkpoint "
                "and release",
            )
            continue
        own = held_for.get(request.run_id, Capacity(()))
        found = _find_place(
            request, general, own, reserved, spare_capacity, reservation, now, default_runtime_s
        )
        if found is not None:
            placed, pools = found
            held = _held(request, pools, placed)
            # Whole nodes may hold more than was asked for: the quota sees what is booked, and
            # nodes of exactly the asked size are tried before giving up.
            booked = check(config, used, request, held)
            if not booked.allowed and request.nodes > 1:
                exact = [_exact_size(pool, request.gpus_per_node) for pool in pools]
                view = exact[0]
                for extra in exact[1:]:
                    view = view.merged(extra)
                fitted = place(request, view)
                if fitted is not None:
                    placed, held = fitted, request.gpus
                    booked = check(config, used, request, held)
            if not booked.allowed:
                wait(
                    position,
                    request,
                    f"placed on whole nodes it would hold {held} GPUs: {booked.reason}",
                )
                continue
            _take(request, pools, placed)
            decisions.grants.append((request, placed))
            for queue in config.ancestry(request.team):
                used[queue.name] = used.get(queue.name, 0) + held
            decisions.spares -= set(placed)
            granted_now.append(_as_allocation(request, pools, placed, now, default_runtime_s))
            continue
        if preemption and not quota.borrowing:
            candidates = [a for a in running if a.run_id not in being_preempted]
            chosen = choose_victims(request, general.merged(own), candidates, lenders, now)
            if chosen and not _books_within_quota(config, used, request, chosen[1], state.nodes):
                chosen = None  # the nodes it would get hold more than its quota allows
            if chosen:
                victims, target = chosen
                deadline = now + timedelta(seconds=config.preemption_grace_s)
                # The target nodes are held for this request from now on: nothing else may take
                # what is free there or what the victims free (an older, requeued victim
                # would take it straight back, and the request would preempt again).
                until = deadline + timedelta(seconds=config.preemption_grace_s)
                decisions.claims.append(Claim(run_id=request.run_id, nodes=target, until=until))
                all_claimed = all_claimed.merged(general.split(target))
                for victim in victims:
                    notice = Preemption(
                        for_run=request.run_id,
                        reason=f"{request.run_id} (team {request.team}) reclaims its guarantee",
                        deadline=deadline,
                    )
                    decisions.preemptions.append((victim.run_id, notice))
                    being_preempted.add(victim.run_id)
                names = ", ".join(v.run_id for v in victims)
                wait(position, request, f"reclaiming its team's guarantee: preempting {names}")
                continue
        if reservation is None:
            # Every gang frees its nodes some day, those being preempted too; claimed nodes
            # count as free (their claimant takes them now and frees them later).
            reservation = reserve(
                request, general.merged(all_claimed), state.allocations + granted_now, now
            )
            if reservation is None:
                wait(
                    position,
                    request,
                    f"needs {request.nodes} node(s) × {request.gpus_per_node} GPU(s)"
                    + (f" of type {request.gpu_type}" if request.gpu_type else "")
                    + ": more than the cluster's schedulable nodes can ever give",
                )
                continue
            # The reserved nodes leave the general pool: only short jobs may borrow them.
            reserved = general.split(reservation.nodes)
            decisions.reservation = reservation
            decisions.preemptions += _overdue(state, reservation, now, being_preempted)
            wait(
                position,
                request,
                f"head of the line: {len(reservation.nodes)} node(s) reserved from "
                f"{reservation.start:%Y-%m-%d %H:%M:%S} UTC",
            )
            continue
        wait(position, request, f"no capacity: behind {reservation.run_id}'s reservation")
    return decisions


def _books_within_quota(
    config: ClusterConfig, used: dict[str, int], request: GangRequest, target: list[str], nodes
) -> bool:
    sizes = {n.info.node_id: n.info.gpus for n in nodes}
    held = sum(sizes[i] for i in target) if request.nodes > 1 else request.gpus
    return check(config, used, request, held).allowed


def _exact_size(pool: Capacity, gpus: int) -> Capacity:
    return Capacity(
        (pool.info[i], free) for i, free in pool.free.items() if pool.info[i].gpus == gpus
    )


def _per_node(request: GangRequest, pool: Capacity, node_id: str) -> int:
    """A multi-node gang books its nodes whole; a single-node job what it asked for."""
    return pool.info[node_id].gpus if request.nodes > 1 else request.gpus_per_node


def _held(request: GangRequest, pools: list[Capacity], placed: list[str]) -> int:
    return sum(
        _per_node(request, next(p for p in pools if node_id in p.free), node_id)
        for node_id in placed
    )


def _take(request: GangRequest, pools: list[Capacity], placed: list[str]) -> None:
    for node_id in placed:
        pool = next(p for p in pools if node_id in p.free)
        pool.take(node_id, _per_node(request, pool, node_id))


def _as_allocation(
    request: GangRequest,
    pools: list[Capacity],
    placed: list[str],
    now: datetime,
    default_runtime_s: float,
) -> Allocation:
    infos = [next(p for p in pools if i in p.info).info[i] for i in placed]
    return Allocation(
        run_id=request.run_id,
        generation=0,
        nodes=infos,
        gpus_per_node=request.gpus_per_node,
        team=request.team,
        granted_at=now,
        expected_end=expected_end(request, now, default_runtime_s),
    )


def _find_place(
    request: GangRequest,
    general: Capacity,
    own: Capacity,
    reserved: Capacity,
    spares: Capacity,
    reservation: Reservation | None,
    now: datetime,
    default_runtime_s: float,
) -> tuple[list[str], list[Capacity]] | None:
    """Where the request fits, and the pools its nodes come from (nothing is booked yet)."""
    options: list[list[Capacity]] = [[general, own] if own.free else [general]]
    if reservation is not None and fits_before(request, reservation, now, default_runtime_s):
        options.append([reserved])
    if request.recovery and spares.free:
        # A gang recovering from a failure may swap spares in beside ordinary free nodes.
        options.append([general, own, spares])
    for pools in options:
        view = pools[0]
        for extra in pools[1:]:
            view = view.merged(extra)
        placed = place(request, view)
        if placed is not None:
            return placed, pools
    return None


def _drain_preemptions(
    state: ClusterState, draining: set[str], now: datetime
) -> list[tuple[str, Preemption]]:
    """A draining node gives back what it runs: its gangs checkpoint and move elsewhere."""
    if not draining:
        return []
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
