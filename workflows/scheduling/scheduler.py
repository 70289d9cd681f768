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
from workflows.scheduling.quotas import QuotaCheck, borrowed, check, fair_share_key, in_use
from workflows.scheduling.topology import in_force, one_unit, unknown_level
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
    usable: list[tuple[NodeInfo, int]],
    spares: set[str],
    owner: dict[str, str],
    levels: tuple[str, ...],
) -> tuple[Capacity, Capacity, dict[str, Capacity], Capacity]:
    """The schedulable nodes' free GPUs: the general pool (neither spare nor claimed), the spare
    pool, what is held for each claimant, and all that is claimed; all placed by `levels`."""
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
        held_for.setdefault(owner[info.node_id], Capacity((), levels)).add(info, free)
    return (
        Capacity(general, levels),
        Capacity(spare, levels),
        held_for,
        Capacity(claimed, levels),
    )


def schedule(state: ClusterState, now: datetime, switches: Switches = TODAY) -> Decisions:
    """One pass: the cluster runs it with every switch on (`TODAY`); `switches` turns parts
    off for histories recorded before them and for the simulator's weaker policies."""
    return SchedulingPass(state, now, switches).run()


@dataclass(frozen=True)
class Waits:
    """Why a request waits this pass (the step that said so decided it)."""

    reason: str


@dataclass(frozen=True)
class Granted:
    """The request was granted these nodes (the step booked them in the decisions)."""

    nodes: list[str]


@dataclass
class _Candidate:
    """One request as the pass considers it; the steps fill in what later steps read."""

    position: int
    request: GangRequest
    quota: QuotaCheck | None = None
    kept: tuple[Reservation, Capacity] | None = None  # its reservation from the last pass
    own: list[Capacity] = field(default_factory=list)  # pools held for it alone


class SchedulingPass:
    """One pass over the queue, in order: for each request the steps run in turn until one
    decides, with a grant or the reason the request waits.

    1. `admit`: its team's quota allows it, and nothing it must wait for stands first.
    2. `place`: free nodes, nodes held for it, and (backfill) reserved nodes it would leave
       before the reservation starts, or as a yielder; spares for recovering gangs.
    3. `reclaim`: within its team's guarantee, preempt borrowers (after `reclaim_after_s`).
    4. `reserve`: the head of the line (and with the guard every long-waiting request) holds
       the nodes it will get, from when they free.

    Before the queue, draining nodes give their gangs notice and the guard keeps last pass's
    reservations; after it, shrunk elastic gangs grow back on what the queue left free.
    """

    def __init__(self, state: ClusterState, now: datetime, switches: Switches) -> None:
        self.state, self.now, self.switches = state, now, switches
        config = self.config = state.config
        self.default_runtime_s = config.default_max_runtime_h * 3600
        sweep = _sweep(state.nodes)
        # Each request as placed now: a topology it waited for long enough is only preferred.
        self.requests = {r.run_id: in_force(r, now) for r in state.queue}
        # Last pass's reservations of runs still queued (those `keep_reservations` may keep).
        reserved = (
            {n for held in state.reservations if held.run_id in self.requests for n in held.nodes}
            if switches.spares_off_reservations
            else set()
        )
        self.decisions = Decisions(spares=choose_spares(sweep.idle, config.spare_nodes, reserved))
        holders = claim_holders(state)
        # Claimed nodes are held for their claimant (the first claim on a node wins).
        owner: dict[str, str] = {}
        for claim in state.claims:
            if claim.until > now and claim.run_id in holders:
                for node_id in claim.nodes:
                    if node_id not in self.decisions.spares:
                        owner.setdefault(node_id, claim.run_id)
        # `all_claimed` grows with this pass's claims.
        self.general, self.spare_capacity, self.held_for, self.all_claimed = _pools(
            sweep.usable, self.decisions.spares, owner, tuple(config.levels)
        )
        self.draining = sweep.draining
        self.used = in_use(config, state.allocations)
        self.lenders = borrowed(config, state.allocations)
        self.running = [a for a in state.allocations if a.preempting is None]
        self.granted_now: list[Allocation] = []  # this pass's grants: they free up too
        self.being_preempted = {a.run_id for a in state.allocations if a.preempting}
        self.reclaiming = {a.preempting.for_run for a in state.allocations if a.preempting}
        # Each reservation with the nodes it holds back: only requests that end before its
        # start may use them. The head of the line's is the first; the guard adds the
        # long-waiting ones'.
        self.reservations: list[tuple[Reservation, Capacity]] = []
        self.reserved_ids: set[str] = set()
        # What reservations are made on: built again only after a grant or a reservation (a
        # claim moves nodes from `general` to `all_claimed`, which leaves the union as it
        # was); with the guard a pass may make dozens, and copying 2,500 nodes for each was
        # most of a pass.
        self.free_later, self.built_at = Capacity((), tuple(config.levels)), (-1, -1)
        self.mine: dict[str, tuple[Reservation, Capacity]] = {}  # run id -> kept reservation
        self.deadline = switches.starvation_guard and switches.start_deadline
        self.yielding = self.deadline and switches.yielding_backfill
        self.patient: set[str] = set()  # within their guarantee, not waited `reclaim_after_s`

    def run(self) -> Decisions:
        decisions = self.decisions
        decisions.preemptions += _drain_preemptions(self.state, self.draining, self.now)
        self.being_preempted |= {victim for victim, _ in decisions.preemptions}
        if self.switches.starvation_guard:
            self._keep_reservations()
        for position, request in enumerate(
            order(self.state, self.now, self.switches.arrival_order)
        ):
            candidate = _Candidate(position, self.requests[request.run_id])
            for step in (self.admit, self.place, self.reclaim, self.reserve):
                outcome = step(candidate)
                if isinstance(outcome, Waits):
                    decisions.waiting.append(
                        Waiting(run_id=request.run_id, position=position, reason=outcome.reason)
                    )
                if outcome is not None:
                    break
        for waiting in decisions.waiting:  # whatever else it waits for, say when it reclaims
            if waiting.run_id in self.patient:
                at = reclaim_at(self.requests[waiting.run_id], self.now, self.config)
                waiting.reason += (
                    f"; within its team's guarantee, it reclaims from borrowers at "
                    f"{at.strftime('%H:%M:%S UTC')}"
                )
        if self.switches.preemption:
            _grow_shrunk_gangs(
                self.state, decisions, self.general, self.used, self.being_preempted, self.now
            )
        return decisions

    def _keep_reservations(self) -> None:
        """The guard keeps last pass's reservations where they still stand, before any other
        is made: remade every pass, a reservation went to whoever came first in line that pass
        (a requeued victim, a failed gang), and a 1,024-GPU gang's start slipped 25 times, by
        28 h."""
        state, now = self.state, self.now
        for kept, pool in keep_reservations(state, self.general, self.requests, now, self.deadline):
            self.reservations.append((kept, pool))
            self.reserved_ids.update(kept.nodes)
            self.decisions.reservations.append(kept)
            self.mine[kept.run_id] = (kept, pool)
            overdue = clearing(
                state, kept, self.requests[kept.run_id], now, self.being_preempted,
                self.deadline, self.yielding,
            )  # fmt: skip
            self.decisions.preemptions += overdue
            self.being_preempted |= {victim for victim, _ in overdue}

    def _hosts_yielders(self, reservation: Reservation) -> bool:
        """A long-waiting request's reservation (kept from pass to pass) that starts later."""
        owner = self.requests.get(reservation.run_id)
        return (
            self.yielding
            and owner is not None
            and long_waiting(owner, self.now, self.config)
            and may_host_yielders(reservation, self.now, self.config)
        )

    def admit(self, candidate: _Candidate) -> Waits | None:
        request = candidate.request
        candidate.quota = quota = check(self.config, self.used, request)
        if not quota.allowed:
            return Waits(quota.reason)
        never = unknown_level(request, tuple(self.config.levels))
        if never is not None:
            return Waits(never)
        reservation = self.decisions.reservation
        if reservation is not None and not self.switches.backfill:
            return Waits(f"no backfill: behind {reservation.run_id}")
        if request.run_id in self.reclaiming:
            return Waits(
                "reclaiming its team's guarantee: waiting for the preempted gang to checkpoint "
                "and release"
            )
        return None

    def place(self, candidate: _Candidate) -> Waits | Granted | None:
        asked = candidate.request
        candidate.kept = kept = self.mine.get(asked.run_id)
        candidate.own = own = [
            p for p in (self.held_for.get(asked.run_id), kept and kept[1]) if p and p.free
        ]
        fit = functools.partial(
            find_place,
            general=self.general,
            own=own,
            reservations=self.reservations,
            spares=self.spare_capacity,
            now=self.now,
            default_runtime_s=self.default_runtime_s,
            hosts_yielders=self._hosts_yielders,
            yield_latest_first=self.switches.yield_latest_first,
        )
        request, found = largest_fit(asked, fit)
        candidate.request = request
        if found is None:
            return None
        placed, pools, yields_to = found
        held = held_gpus(request, pools, placed)
        # Whole nodes may hold more than was asked for: the quota sees what is booked, and
        # nodes of exactly the asked size are tried before giving up.
        booked = check(self.config, self.used, request, held)
        if not booked.allowed and request.nodes > 1:
            exact = [exact_size(pool, request.gpus_per_node) for pool in pools]
            fitted = place(request, merged(exact))
            if fitted is not None:
                placed, held = fitted, request.gpus
                booked = check(self.config, self.used, request, held)
        if not booked.allowed:
            return Waits(f"placed on whole nodes it would hold {held} GPUs: {booked.reason}")
        decisions = self.decisions
        take(request, pools, placed, where_free=self.yielding)
        decisions.grants.append((request, placed))
        if yields_to is not None:
            decisions.yielding[request.run_id] = yields_to
        if request.nodes < asked.nodes:
            decisions.shrunk[request.run_id] = asked
        for queue in self.config.ancestry(request.team):
            self.used[queue.name] = self.used.get(queue.name, 0) + held
        decisions.spares -= set(placed)
        self.granted_now.append(
            _as_allocation(request, pools, placed, self.now, self.default_runtime_s)
        )
        return Granted(placed)

    def reclaim(self, candidate: _Candidate) -> Waits | None:
        request, config, now = candidate.request, self.config, self.now
        assert candidate.quota is not None
        if not self.switches.preemption or candidate.quota.borrowing:
            return None
        if not reclaims_now(request, now, config, self.switches.reclaim_patience):
            self.patient.add(request.run_id)
            return None
        guard = self.switches.starvation_guard
        candidates = [
            a
            for a in self.running
            if a.run_id not in self.being_preempted and not (guard and _shielded(a, now, config))
        ]
        kept, own = candidate.kept, candidate.own
        restart_s, around = 0.0, merged([self.general, *own])
        # With the guard, what a victim frees on reserved nodes is not this request's.
        if guard:
            restart_s = config.preemption_restart_s
            others = self.reserved_ids - set(kept[0].nodes if kept else ())
            around = without([self.general, *own], others)
        chosen = choose_victims(request, around, candidates, self.lenders, now, restart_s)
        if chosen and not _books_within_quota(
            config, self.used, request, chosen[1], self.state.nodes
        ):
            chosen = None  # the nodes it would get hold more than its quota allows
        if not chosen:
            return None
        victims, target = chosen
        grace_ends = now + timedelta(seconds=config.preemption_grace_s)
        # The target nodes are held for this request from now on: nothing else may take what
        # is free there or what the victims free (an older, requeued victim would take it
        # straight back, and the request would preempt again).
        until = grace_ends + timedelta(seconds=config.preemption_grace_s)
        self.decisions.claims.append(Claim(run_id=request.run_id, nodes=target, until=until))
        self.all_claimed = self.all_claimed.merged(self.general.split(target))
        for victim in victims:
            notice = Preemption(
                for_run=request.run_id,
                reason=f"{request.run_id} (team {request.team}) reclaims its guarantee",
                deadline=grace_ends,
            )
            self.decisions.preemptions.append((victim.run_id, notice))
            self.being_preempted.add(victim.run_id)
        names = ", ".join(v.run_id for v in victims)
        return Waits(f"reclaiming its team's guarantee: preempting {names}")

    def reserve(self, candidate: _Candidate) -> Waits:
        request, kept, decisions = candidate.request, candidate.kept, self.decisions
        head = decisions.reservation is None
        if kept is not None:  # kept from the last pass: it stands as it was
            decisions.reservation = kept[0] if head else decisions.reservation
            return Waits("its reservation holds: " + _described(kept[0], request))
        reservation: Reservation | None = None
        guarded = self.switches.starvation_guard and long_waiting(request, self.now, self.config)
        if head or guarded:
            # Every gang frees its nodes some day, those being preempted too; claimed nodes
            # count as free (their claimant takes them now and frees them later), reserved
            # ones do not (an earlier reservation has them).
            if self.built_at != (len(self.granted_now), len(self.reserved_ids)):
                self.free_later = without([self.general, self.all_claimed], self.reserved_ids)
                self.built_at = (len(self.granted_now), len(self.reserved_ids))
            allocations = self.state.allocations + self.granted_now
            reservation = reserve(request, self.free_later, allocations, self.now)
            if (
                reservation is not None and self.deadline and guarded
            ):  # the deadline needs the guard
                reservation = held_by_deadline(reservation, request, self.config, self.now)
            if reservation is None and head and self.reserved_ids:
                return Waits("no capacity: the nodes it needs are reserved")
            if reservation is None and head:
                avoided = ", ".join(request.avoid)
                return Waits(
                    f"needs {request.nodes} node(s) × {request.gpus_per_node} GPU(s)"
                    + (f" of type {request.gpu_type}" if request.gpu_type else "")
                    + one_unit(request)
                    + ": more than the cluster's schedulable nodes can ever give"
                    + (f" without {avoided}, which its ranks reported" if avoided else "")
                )
        if reservation is None:
            behind = decisions.reservation.run_id if decisions.reservation else "the reservations"
            return Waits(f"no capacity: behind {behind}'s reservation")
        # The reserved nodes leave the general pool: only short jobs may borrow them.
        self.reservations.append((reservation, self.general.split(reservation.nodes)))
        self.reserved_ids.update(reservation.nodes)
        decisions.reservations.append(reservation)
        if head:
            decisions.reservation = reservation
        overdue = clearing(
            self.state, reservation, request, self.now, self.being_preempted, self.deadline,
            self.yielding,
        )  # fmt: skip
        decisions.preemptions += overdue
        # With the guard, a later reservation must not stop the same gang again.
        if self.switches.starvation_guard:
            self.being_preempted |= {victim for victim, _ in overdue}
        return Waits(
            ("head of the line" if head else "waited past the guard's limit")
            + ": "
            + _described(reservation, request)
        )


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


def _described(reservation: Reservation, request: GangRequest) -> str:
    return (
        f"{len(reservation.nodes)} node(s){one_unit(request)} reserved from "
        f"{reservation.start:%Y-%m-%d %H:%M:%S} UTC"
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
