"""One scheduling pass: a pure function from the cluster state to decisions.

Order: effective priority (priority plus one level per `aging_s` waited, so nothing waits
forever), then fair share (decayed usage over guarantee), then age. For each request in order:
quota check, placement (outside the head-of-line reservation, or inside it if the request ends
before the reservation starts), else reclaim the team's guarantee by preemption, else the first
such request becomes the head of the line and gets a reservation. Spare nodes are held back for
recovery requests. The `Cluster` workflow applies the decisions; nothing here mutates its input.

The starvation guard (on by default; off is the policy before it, which histories recorded
under it replay with): every request that has waited `reserve_after_s` gets a reservation of
its own, not only the head of the line, and keeps it on the same nodes from pass to pass; a gang
granted less than `preemption_shield_s` ago is no victim, and a victim's loss counts the restart
it repeats (`preemption_restart_s`). Without it, aging decides only who is first in line, and
a big gang that is not first waits while every node freed outside the head's reservation goes
to younger small jobs.

The start deadline (with the guard, on by default; `start_deadline=False` for histories before
it; `held_reservations` keeps and clears the guard's reservations): a long-waiting
request that has never run starts by `start_within_s` after its submission. Its reservation
starts no later than that, and then the gangs still on its nodes are preempted unless they
outrank it. Without it a reservation started when the running gangs' declared max runtimes
said, and in a burst of 1,024-GPU gangs that was a day and more away.

Yielding backfill (with the deadline, on by default; `yielding_backfill=False` for histories
before it): a preemptible request that fits nowhere else may run on a long-waiting request's
reserved nodes until that reservation is about to start, then it is preempted with the usual
grace (`workflows.scheduling.yielding`).

Reclaim patience (on by default; off for histories before it): a request within its team's
guarantee preempts borrowers only once it has waited `reclaim_after_s` since its submission
(`preemption.reclaims_now`); until then nodes that free on their own serve it. The switches of
every part are `workflows.scheduling.policy_switches.Switches`.
"""

from __future__ import annotations

import functools
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from workflows.contracts.cluster_models import (
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
from workflows.scheduling.backfill import reserve, runtime
from workflows.scheduling.elastic import claim_holders, grow_back, grow_claim, largest_fit
from workflows.scheduling.held_reservations import (
    clearing,
    held_by_deadline,
    keep_reservations,
    long_waiting,
)
from workflows.scheduling.placement import Capacity, place
from workflows.scheduling.policy_switches import TODAY, Switches
from workflows.scheduling.pool_booking import (
    exact_size,
    find_place,
    held_gpus,
    merged,
    take,
    without,
)
from workflows.scheduling.preemption import choose_victims, reclaim_at, reclaims_now
from workflows.scheduling.quotas import borrowed, check, fair_share_key, in_use
from workflows.scheduling.yielding import may_host_yielders


@dataclass
class Decisions:
    grants: list[tuple[GangRequest, list[str]]] = field(default_factory=list)
    preemptions: list[tuple[str, Preemption]] = field(default_factory=list)
    reservation: Reservation | None = None  # the head of the line's
    reservations: list[Reservation] = field(default_factory=list)  # every one, the head's first
    waiting: list[Waiting] = field(default_factory=list)
    spares: set[str] = field(default_factory=set)
    claims: list[Claim] = field(default_factory=list)
    # Gangs granted smaller than asked (elastic), by run: the full request each grows back to.
    shrunk: dict[str, GangRequest] = field(default_factory=dict)
    # Gangs placed on a reservation's nodes as yielders, by run: whose reservation.
    yielding: dict[str, str] = field(default_factory=dict)


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


def choose_spares(
    nodes: list[Node], count: int, reserved: AbstractSet[str] = frozenset()
) -> set[str]:
    """Keep `count` healthy, idle, active nodes back; current spares stay spares if they can.
    Never a `reserved` node (held for a long-waiting run): in the three-week simulation the pool
    refilled from nodes a reservation had just seen freed, 24 reservations were dropped that way,
    and the nodes went to whoever came first in line."""
    eligible = [n for n in nodes if n.schedulable and not n.jobs and n.info.node_id not in reserved]
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


def schedule(state: ClusterState, now: datetime, switches: Switches = TODAY) -> Decisions:
    """One pass: the cluster runs it with every switch on (`TODAY`); `switches` turns parts
    off for histories recorded before them and for the simulator's weaker policies."""
    config = state.config
    default_runtime_s = config.default_max_runtime_h * 3600
    sweep = _sweep(state.nodes)
    requests = {r.run_id: r for r in state.queue}
    # Last pass's reservations of runs still queued (those `keep_reservations` may keep).
    reserved = (
        {n for held in state.reservations if held.run_id in requests for n in held.nodes}
        if switches.spares_off_reservations
        else set()
    )
    decisions = Decisions(spares=choose_spares(sweep.idle, config.spare_nodes, reserved))
    holders = claim_holders(state)
    # Claimed nodes are held for their claimant (the first claim on a node wins).
    owner: dict[str, str] = {}
    for claim in state.claims:
        if claim.until > now and claim.run_id in holders:
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
    # Each reservation with the nodes it holds back: only requests that end before its start
    # may use them. The head of the line's is the first; the guard adds the long-waiting ones'.
    reservations: list[tuple[Reservation, Capacity]] = []
    reserved_ids: set[str] = set()
    # What reservations are made on: built again only after a grant or a reservation (a claim
    # moves nodes from `general` to `all_claimed`, which leaves the union as it was); with the
    # guard a pass may make dozens, and copying 2,500 nodes for each was most of a pass.
    free_later, built_at = Capacity(()), (-1, -1)

    decisions.preemptions += _drain_preemptions(state, sweep.draining, now)
    being_preempted |= {victim for victim, _ in decisions.preemptions}
    # The guard keeps last pass's reservations where they still stand, before any other is
    # made: remade every pass, a reservation went to whoever came first in line that pass (a
    # requeued victim, a failed gang), and a 1,024-GPU gang's start slipped 25 times, by 28 h.
    mine: dict[str, tuple[Reservation, Capacity]] = {}  # run id -> its kept reservation
    deadline = switches.starvation_guard and switches.start_deadline
    yielding = deadline and switches.yielding_backfill

    def hosts_yielders(reservation: Reservation) -> bool:
        """A long-waiting request's reservation (kept from pass to pass) that starts later."""
        owner = requests.get(reservation.run_id)
        return (
            yielding
            and owner is not None
            and long_waiting(owner, now, config)
            and may_host_yielders(reservation, now, config)
        )

    if switches.starvation_guard:
        for kept, pool in keep_reservations(state, general, requests, now, deadline):
            reservations.append((kept, pool))
            reserved_ids.update(kept.nodes)
            decisions.reservations.append(kept)
            mine[kept.run_id] = (kept, pool)
            overdue = clearing(
                state, kept, requests[kept.run_id], now, being_preempted, deadline, yielding
            )
            decisions.preemptions += overdue
            being_preempted |= {victim for victim, _ in overdue}

    patient: set[str] = set()  # within their guarantee, not yet waited `reclaim_after_s`

    def wait(position: int, request: GangRequest, reason: str) -> None:
        decisions.waiting.append(Waiting(run_id=request.run_id, position=position, reason=reason))

    for position, request in enumerate(order(state, now, switches.arrival_order)):
        quota = check(config, used, request)
        if not quota.allowed:
            wait(position, request, quota.reason)
            continue
        if decisions.reservation is not None and not switches.backfill:
            wait(position, request, f"no backfill: behind {decisions.reservation.run_id}")
            continue
        if request.run_id in reclaiming:
            wait(
                position,
                request,
                "reclaiming its team's guarantee: waiting for the preempted gang to checkpoint "
                "and release",
            )
            continue
        kept = mine.get(request.run_id)
        own = [p for p in (held_for.get(request.run_id), kept and kept[1]) if p and p.free]
        fit = functools.partial(
            find_place,
            general=general,
            own=own,
            reservations=reservations,
            spares=spare_capacity,
            now=now,
            default_runtime_s=default_runtime_s,
            hosts_yielders=hosts_yielders,
            yield_latest_first=switches.yield_latest_first,
        )
        asked = request
        request, found = largest_fit(request, fit)
        if found is not None:
            placed, pools, yields_to = found
            held = held_gpus(request, pools, placed)
            # Whole nodes may hold more than was asked for: the quota sees what is booked, and
            # nodes of exactly the asked size are tried before giving up.
            booked = check(config, used, request, held)
            if not booked.allowed and request.nodes > 1:
                exact = [exact_size(pool, request.gpus_per_node) for pool in pools]
                fitted = place(request, merged(exact))
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
            take(request, pools, placed, where_free=yielding)
            decisions.grants.append((request, placed))
            if yields_to is not None:
                decisions.yielding[request.run_id] = yields_to
            if request.nodes < asked.nodes:
                decisions.shrunk[request.run_id] = asked
            for queue in config.ancestry(request.team):
                used[queue.name] = used.get(queue.name, 0) + held
            decisions.spares -= set(placed)
            granted_now.append(_as_allocation(request, pools, placed, now, default_runtime_s))
            continue
        may_reclaim = switches.preemption and not quota.borrowing
        if may_reclaim and not reclaims_now(request, now, config, switches.reclaim_patience):
            patient.add(request.run_id)
            may_reclaim = False
        if may_reclaim:
            candidates = [
                a
                for a in running
                if a.run_id not in being_preempted
                and not (switches.starvation_guard and _shielded(a, now, config))
            ]
            restart_s, around = 0.0, merged([general, *own])
            # With the guard, what a victim frees on reserved nodes is not this request's.
            if switches.starvation_guard:
                restart_s = config.preemption_restart_s
                around = without([general, *own], reserved_ids - set(kept[0].nodes if kept else ()))
            chosen = choose_victims(request, around, candidates, lenders, now, restart_s)
            if chosen and not _books_within_quota(config, used, request, chosen[1], state.nodes):
                chosen = None  # the nodes it would get hold more than its quota allows
            if chosen:
                victims, target = chosen
                # Not `deadline`: that name is the start-deadline switch, which a datetime here
                # once turned on for the rest of the pass (test_start_deadline.py).
                grace_ends = now + timedelta(seconds=config.preemption_grace_s)
                # The target nodes are held for this request from now on: nothing else may take
                # what is free there or what the victims free (an older, requeued victim
                # would take it straight back, and the request would preempt again).
                until = grace_ends + timedelta(seconds=config.preemption_grace_s)
                decisions.claims.append(Claim(run_id=request.run_id, nodes=target, until=until))
                all_claimed = all_claimed.merged(general.split(target))
                for victim in victims:
                    notice = Preemption(
                        for_run=request.run_id,
                        reason=f"{request.run_id} (team {request.team}) reclaims its guarantee",
                        deadline=grace_ends,
                    )
                    decisions.preemptions.append((victim.run_id, notice))
                    being_preempted.add(victim.run_id)
                names = ", ".join(v.run_id for v in victims)
                wait(position, request, f"reclaiming its team's guarantee: preempting {names}")
                continue
        head = decisions.reservation is None
        if kept is not None:  # kept from the last pass: it stands as it was
            decisions.reservation = kept[0] if head else decisions.reservation
            wait(position, request, "its reservation holds: " + _described(kept[0]))
            continue
        reservation: Reservation | None = None
        if head or (switches.starvation_guard and long_waiting(request, now, config)):
            # Every gang frees its nodes some day, those being preempted too; claimed nodes
            # count as free (their claimant takes them now and frees them later), reserved ones
            # do not (an earlier reservation has them).
            if built_at != (len(granted_now), len(reserved_ids)):
                free_later = without([general, all_claimed], reserved_ids)
                built_at = (len(granted_now), len(reserved_ids))
            reservation = reserve(request, free_later, state.allocations + granted_now, now)
            if reservation is not None and deadline and long_waiting(request, now, config):
                reservation = held_by_deadline(reservation, request, config, now)
            if reservation is None and head and reserved_ids:
                wait(position, request, "no capacity: the nodes it needs are reserved")
                continue
            if reservation is None and head:
                wait(
                    position,
                    request,
                    f"needs {request.nodes} node(s) × {request.gpus_per_node} GPU(s)"
                    + (f" of type {request.gpu_type}" if request.gpu_type else "")
                    + ": more than the cluster's schedulable nodes can ever give",
                )
                continue
        if reservation is not None:
            # The reserved nodes leave the general pool: only short jobs may borrow them.
            reservations.append((reservation, general.split(reservation.nodes)))
            reserved_ids.update(reservation.nodes)
            decisions.reservations.append(reservation)
            if head:
                decisions.reservation = reservation
            overdue = clearing(
                state, reservation, request, now, being_preempted, deadline, yielding
            )
            decisions.preemptions += overdue
            # With the guard, a later reservation must not stop the same gang again.
            if switches.starvation_guard:
                being_preempted |= {victim for victim, _ in overdue}
            wait(
                position,
                request,
                ("head of the line" if head else "waited past the guard's limit")
                + ": "
                + _described(reservation),
            )
            continue
        behind = decisions.reservation.run_id if decisions.reservation else "the reservations"
        wait(position, request, f"no capacity: behind {behind}'s reservation")
    for waiting in decisions.waiting:  # whatever else it waits for, say when it reclaims
        if waiting.run_id in patient:
            at = reclaim_at(requests[waiting.run_id], now, config).strftime("%H:%M:%S UTC")
            waiting.reason += f"; within its team's guarantee, it reclaims from borrowers at {at}"
    if switches.preemption:
        _grow_shrunk_gangs(state, decisions, general, used, being_preempted, now)
    return decisions


def _grow_shrunk_gangs(
    state: ClusterState,
    decisions: Decisions,
    general: Capacity,
    used: dict[str, int],
    being_preempted: set[str],
    now: datetime,
) -> None:
    """What the queue left free grows shrunk gangs back: each stops at a checkpoint (a
    notice with `grow_to`) while its full gang's nodes are claimed for it."""
    grace_s = state.config.preemption_grace_s
    deadline = now + timedelta(seconds=grace_s)
    for allocation, target in grow_back(
        state.config, state.allocations, general, used, being_preempted, now
    ):
        assert allocation.wanted is not None
        nodes = allocation.wanted.nodes
        notice = Preemption(
            for_run=allocation.run_id,
            reason=f"grows back to {nodes} nodes",
            deadline=deadline,
            grow_to=nodes,
        )
        decisions.preemptions.append((allocation.run_id, notice))
        decisions.claims.append(grow_claim(allocation.run_id, target, deadline, grace_s))


def _described(reservation: Reservation) -> str:
    return (
        f"{len(reservation.nodes)} node(s) reserved from {reservation.start:%Y-%m-%d %H:%M:%S} UTC"
    )


def _shielded(allocation: Allocation, now: datetime, config: ClusterConfig) -> bool:
    """Just granted, so the cheapest victim there is (little work since its start to lose), yet
    preempting it throws away its restart and sends it back to the queue, where its age puts it
    first again: granted and preempted over and over."""
    if allocation.granted_at is None:
        return False
    return (now - allocation.granted_at).total_seconds() < config.preemption_shield_s


def _books_within_quota(
    config: ClusterConfig, used: dict[str, int], request: GangRequest, target: list[str], nodes
) -> bool:
    sizes = {n.info.node_id: n.info.gpus for n in nodes}
    held = sum(sizes[i] for i in target) if request.nodes > 1 else request.gpus
    return check(config, used, request, held).allowed


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


def expected_end(request: GangRequest, granted_at: datetime, default_runtime_s: float) -> datetime:
    return granted_at + runtime(request, default_runtime_s)
