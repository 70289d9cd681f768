"""Properties of the scheduling policy, checked on random clusters driven by the simulator.

Each test draws a scenario (`tests.workflows.scheduling.policy_scenarios`), runs
`tests.workflows.scheduling.simulation.Simulator` over it and checks one property at every pass
(or at the end, for liveness). A bug the properties found keeps its minimal example as an
`@example`.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime, timedelta

from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from tests.workflows.scheduling.policy_fixtures import NOW, node, request, running, teams
from tests.workflows.scheduling.policy_scenarios import (
    GPU_COUNTS,
    REGRESSION_SETTINGS,
    SETTINGS,
    Scenario,
    any_scenario,
    cluster_nodes,
    contended,
    fill,
    hold,
    scenarios,
)
from tests.workflows.scheduling.simulation import REVOKE_MARGIN, TICK, Arrival, Simulator
from workflows.contracts.cluster_models import (
    Admin,
    ClusterConfig,
    ClusterState,
    GangRequest,
    QueueConfig,
)
from workflows.scheduling.cluster_ops import apply
from workflows.scheduling.placement import Capacity, place
from workflows.scheduling.quotas import borrowed, check, in_use
from workflows.scheduling.scheduler import Decisions, choose_spares, schedule


def holders(state: ClusterState) -> dict[str, set[str]]:
    held: dict[str, set[str]] = defaultdict(set)
    for allocation in state.allocations:
        for info in allocation.nodes:
            held[info.node_id].add(allocation.run_id)
    return held


def assert_no_double_booking(sim: Simulator) -> None:
    state = sim.state
    held = holders(state)
    for n in state.nodes:
        assert n.used <= n.info.gpus, f"{n.info.node_id} booked {n.jobs} on {n.info.gpus} GPUs"
        assert set(n.jobs) == held[n.info.node_id], f"{n.info.node_id}: {n.jobs} vs {held}"


def assert_whole_gangs(state: ClusterState, decisions: Decisions, now: datetime) -> None:
    by_id = {n.info.node_id: n for n in state.nodes}
    spares = choose_spares(state.nodes, state.config.spare_nodes)
    booked = {node_id: n.used for node_id, n in by_id.items()}  # grows with this pass's grants
    for req, node_ids in decisions.grants:
        assert len(node_ids) == len(set(node_ids)) == req.nodes, (req, node_ids)
        for node_id in node_ids:
            n = by_id[node_id]
            assert n.schedulable, f"{req.run_id} granted {n.state} node {node_id}"
            assert req.gpu_type in (None, n.info.gpu_type), (req, n.info)
            assert req.recovery or node_id not in spares, f"{req.run_id} took spare {node_id}"
            if req.nodes > 1:
                assert booked[node_id] == 0, f"gang {req.run_id} on busy node {node_id}"
                assert n.info.gpus >= req.gpus_per_node
                booked[node_id] = n.info.gpus
            else:
                assert n.info.gpus - booked[node_id] >= req.gpus_per_node, (req, n)
                booked[node_id] += req.gpus_per_node


def assert_quotas_as_requested(state: ClusterState, decisions: Decisions, now: datetime) -> None:
    """Ceilings and guarantees in the GPUs requests ask for (what `quotas.check` adds up)."""
    config = state.config
    used = in_use(config, state.allocations)
    for req, _ in decisions.grants:
        for queue in config.ancestry(req.team):
            if queue.max_gpus is not None:
                assert used[queue.name] + req.gpus <= queue.max_gpus, (req, queue, dict(used))
        if not req.preemptible:
            team = config.queue(req.team)
            assert used[team.name] + req.gpus <= team.guaranteed_gpus, (req, team, dict(used))
        for queue in config.ancestry(req.team):
            used[queue.name] += req.gpus


def booked_per_run(state: ClusterState) -> dict[str, int]:
    on_nodes: dict[str, int] = defaultdict(int)
    for n in state.nodes:
        for run_id, gpus in n.jobs.items():
            on_nodes[run_id] += gpus
    return on_nodes


def booked_per_queue(state: ClusterState) -> dict[str, int]:
    """GPUs the nodes actually hold for each queue's runs (ancestors included)."""
    on_nodes = booked_per_run(state)
    used: dict[str, int] = defaultdict(int)
    for allocation in state.allocations:
        for queue in state.config.ancestry(allocation.team):
            used[queue.name] += on_nodes[allocation.run_id]
    return used


def assert_safe_preemptions(state: ClusterState, decisions: Decisions, now: datetime) -> None:
    lenders = borrowed(state.config, state.allocations)
    by_run = {a.run_id: a for a in state.allocations}
    queued = {r.run_id: r for r in state.queue}
    draining = {n.info.node_id for n in state.nodes if n.admin == Admin.DRAINING}
    for victim_id, notice in decisions.preemptions:
        victim = by_run[victim_id]
        assert victim.preempting is None, f"{victim_id} preempted twice"
        if notice.reason.endswith(" is draining"):  # the exception: an operator's drain
            node_id = notice.reason.removeprefix("node ").removesuffix(" is draining")
            assert node_id in draining and node_id in {n.node_id for n in victim.nodes}
            continue
        if notice.reason == "exceeded its max runtime":  # only ever a gang past its own limit
            assert victim.expected_end is not None and victim.expected_end < now
            continue
        assert victim.preemptible, f"non-preemptible {victim_id} preempted"
        if notice.reason.startswith("holds nodes reserved for"):  # a first start's deadline
            requester = queued[notice.for_run]
            waited = now - (requester.submitted_at or now)
            assert not requester.started_before and victim.priority <= requester.priority
            assert waited.total_seconds() >= state.config.start_within_s
            continue
        assert victim_id in lenders, f"{victim_id} is within its team's guarantee"
        requester = queued[notice.for_run]
        assert victim.team != requester.team, f"{victim_id} preempted for its own team"


def run_to_end(scenario: Scenario, days: float = 3, **hooks: object) -> Simulator:
    sim = scenario.simulator(**hooks)
    sim.run(until=NOW + timedelta(days=days), stop=Simulator.quiescent)
    return sim


# --- safety ------------------------------------------------------------------------------------


@SETTINGS
@given(any_scenario)
def test_no_gpu_is_ever_double_booked(scenario: Scenario) -> None:
    run_to_end(scenario, after_pass=assert_no_double_booking)


@SETTINGS
@given(any_scenario)
def test_gangs_are_granted_whole_on_usable_nodes(scenario: Scenario) -> None:
    run_to_end(scenario, on_decisions=assert_whole_gangs)


@SETTINGS
@given(any_scenario)
def test_grants_respect_ceilings_and_guarantees(scenario: Scenario) -> None:
    run_to_end(scenario, on_decisions=assert_quotas_as_requested)


@settings(SETTINGS, max_examples=100)
@given(contended())
def test_preemption_only_takes_borrowed_preemptible_gangs_of_other_teams(
    scenario: Scenario,
) -> None:
    # The first hours of a full cluster are where reclaiming happens (and costs least to run).
    run_to_end(scenario, days=2 / 24, on_decisions=assert_safe_preemptions)


@SETTINGS
@given(any_scenario)
def test_generations_strictly_increase(scenario: Scenario) -> None:
    sim = run_to_end(scenario)
    generations = [t.generation for t in sim.log if t.kind == "grant"]
    assert all(a < b for a, b in itertools.pairwise(generations)), generations


# --- regressions: each was a minimal failing example of an earlier policy --------------------


def over_ceiling_example() -> Scenario:
    """nlp may hold 8 GPUs. A gang of 2 nodes x 2 GPUs passes the check (4 GPUs) but the
    workflow books both 8-GPU nodes whole: nlp holds 16."""
    return Scenario(
        state=ClusterState(config=teams(nlp=(0, 8)), nodes=[node("n0"), node("n1")]),
        arrivals=[Arrival(0, request("r", nodes=2, gpus_per_node=2, team="nlp"))],
    )


def assert_booked_quotas(sim: Simulator) -> None:
    """What nodes hold, per queue: within every ceiling; a non-preemptible grant's team within
    its guarantee."""
    state = sim.state
    used = booked_per_queue(state)
    for queue in state.config.queues:
        if queue.max_gpus is not None:
            assert used[queue.name] <= queue.max_gpus, (queue, dict(used), state.allocations)
    # A non-preemptible grant must fit the guarantee when it is made; preemptible grants later
    # in the same pass may borrow beyond it, so their GPUs are not counted against it.
    held = booked_per_run(state)
    grants = sim.last_decisions.grants
    for i, (req, _) in enumerate(grants):
        if req.preemptible:
            continue
        team = state.config.queue(req.team)
        later = sum(
            held[r.run_id]
            for r, _ in grants[i + 1 :]
            if team.name in {q.name for q in state.config.ancestry(r.team)}
        )
        assert used[team.name] - later <= team.guaranteed_gpus, (req, team, dict(used), later)


@REGRESSION_SETTINGS
@example(over_ceiling_example())
@given(any_scenario)
def test_booked_gpus_stay_within_ceilings_and_guarantees(scenario: Scenario) -> None:
    run_to_end(scenario, after_pass=assert_booked_quotas)


def busy_is_not_never_example() -> Scenario:
    """One 1-GPU node, two 1-GPU requests in one pass: the second is told it can never fit."""
    return Scenario(
        state=ClusterState(nodes=[node("n0", gpus=1)]),
        arrivals=[
            Arrival(0, request("a", gpus_per_node=1)),
            Arrival(0, request("b", gpus_per_node=1)),
        ],
    )


NEVER_FITS = "more than the cluster's schedulable nodes can ever give"


def idle_capacity(state: ClusterState) -> Capacity:
    """Every schedulable node outside the spare pool, as if nothing ran."""
    spares = choose_spares(state.nodes, state.config.spare_nodes)
    return Capacity(
        (n.info, n.info.gpus) for n in state.nodes if n.schedulable and n.info.node_id not in spares
    )


def assert_never_fits_is_true(state: ClusterState, decisions: Decisions, now: datetime) -> None:
    queued = {r.run_id: r for r in state.queue}
    capacity = idle_capacity(state)
    for waiting in decisions.waiting:
        if waiting.reason.endswith(NEVER_FITS):
            req = queued[waiting.run_id]
            assert place(req, capacity) is None, f"{req} fits an idle cluster: {waiting.reason}"


@REGRESSION_SETTINGS
@example(busy_is_not_never_example())
@given(any_scenario)
def test_never_fits_is_said_only_of_requests_that_never_fit(scenario: Scenario) -> None:
    run_to_end(scenario, on_decisions=assert_never_fits_is_true)


# --- liveness ----------------------------------------------------------------------------------


@dataclass
class Reclaim:
    scenario: Scenario
    wanted: GangRequest

    def bound(self) -> datetime:
        # A borrower granted less than the shield ago is no victim until the shield is over;
        # victims release within the grace period or are revoked at the first pass after
        # deadline + 30 s; a pass follows every release, at most a tick follows the margin.
        # The request itself reclaims only once it has waited reclaim_after_s (it arrives now).
        config = self.scenario.state.config
        patience = NOW + timedelta(seconds=config.reclaim_after_s)
        shielded = [
            a.granted_at + timedelta(seconds=config.preemption_shield_s)
            for a in self.scenario.state.allocations
            if a.granted_at is not None
        ]
        start = max([patience, *shielded])
        return start + timedelta(seconds=config.preemption_grace_s) + REVOKE_MARGIN + TICK

    def granted_at(self, **options: object) -> datetime | None:
        sim = self.scenario.simulator(on_decisions=assert_safe_preemptions, **options)
        sim.run(until=self.bound(), stop=lambda s: s.granted_at(self.wanted.run_id) is not None)
        return sim.granted_at(self.wanted.run_id)


@st.composite
def full_of_borrowers(draw: st.DrawFn, whole_nodes: bool = False) -> Reclaim:
    """beta and gamma fill every GPU with preemptible gangs; alpha (guarantee G) asks for at most
    G. beta may have a guarantee too: its oldest gangs are then not borrowed. `whole_nodes`: no
    two gangs share a node."""
    nodes = draw(cluster_nodes(max_nodes=16))
    total = sum(n.info.gpus for n in nodes)
    alpha_g = draw(st.integers(1, total))
    beta_g = draw(st.sampled_from([0, 0, draw(st.integers(0, total - alpha_g))]))
    config = ClusterConfig(
        queues=[
            QueueConfig(name="alpha", guaranteed_gpus=alpha_g),
            QueueConfig(name="beta", guaranteed_gpus=beta_g),
            QueueConfig(name="gamma"),
        ],
        preemption_grace_s=draw(st.integers(30, 600)),
        aging_s=draw(st.floats(600, 7200)),
    )
    state = ClusterState(config=config, nodes=nodes)

    fill(draw, state, ["beta", "gamma"], whole_nodes=whole_nodes)
    k = draw(st.integers(1, min(4, len(nodes))))
    wanted = request(
        "alpha-job",
        nodes=k,
        gpus_per_node=draw(st.sampled_from([g for g in GPU_COUNTS if g * k <= alpha_g] or [1])),
        team="alpha",
        preemptible=draw(st.booleans()),
        priority=draw(st.integers(0, 3)),
        gpu_type=draw(st.none() | st.sampled_from(sorted({n.info.gpu_type for n in nodes}))),
    )
    assume(wanted.gpus <= alpha_g)
    # A gang books its nodes whole: only shapes whose booking stays within the guarantee on
    # any node it could land on can be promised the guarantee.
    eligible = [n.info.gpus for n in nodes if wanted.gpu_type in (None, n.info.gpu_type)]
    assume(k == 1 or k * max(eligible, default=0) <= alpha_g)
    # Reachable: placeable once every borrowed gang is gone (beta's guaranteed ones may stay).
    lenders = borrowed(config, state.allocations)
    freed = Capacity((n.info, n.free) for n in nodes)
    for allocation in state.allocations:
        if allocation.run_id in lenders:
            for info in allocation.nodes:
                freed.give(info.node_id, allocation.gpus_per_node)
    assume(place(wanted, freed) is not None)
    scenario = Scenario(
        state=state,
        arrivals=[Arrival(0, wanted)],
        seed=draw(st.integers(0, 2**16)),
        never_release=draw(st.sampled_from([0.0, 0.5, 1.0])),
    )
    return Reclaim(scenario, wanted)


def requeued_victim_example() -> Reclaim:
    """One 1-GPU node held by a priority-1 beta borrower; alpha (guarantee 1) asks for it."""
    state = ClusterState(config=teams(alpha=(1, None), beta=(0, None)), nodes=[node("n0", gpus=1)])
    hold(state, ["n0"], 1, team="beta", priority=1)
    wanted = request("alpha-job", gpus_per_node=1, team="alpha")
    return Reclaim(Scenario(state, [Arrival(0, wanted)]), wanted)


@REGRESSION_SETTINGS
@example(requeued_victim_example())
@given(full_of_borrowers())
def test_guarantee_is_reached_within_one_grace_period(case: Reclaim) -> None:
    granted = case.granted_at()
    assert granted is not None and granted <= case.bound(), (granted, case.bound())


def shared_node_example() -> Reclaim:
    """One 2-GPU node holding two 1-GPU beta jobs that ignore notices; alpha wants both GPUs."""
    state = ClusterState(config=teams(alpha=(2, None), beta=(0, None)), nodes=[node("n0", gpus=2)])
    hold(state, ["n0"], 1, team="beta")
    hold(state, ["n0"], 1, team="beta")
    wanted = request("alpha-job", gpus_per_node=2, team="alpha")
    return Reclaim(Scenario(state, [Arrival(0, wanted)], never_release=1.0), wanted)


@REGRESSION_SETTINGS
@example(shared_node_example())
@given(full_of_borrowers())
def test_guarantee_is_reached_within_one_grace_period_when_victims_leave(case: Reclaim) -> None:
    """As above, but a preempted run gives up instead of queueing again."""
    granted = case.granted_at(requeue_preempted=False)
    assert granted is not None and granted <= case.bound(), (granted, case.bound())


@settings(SETTINGS, max_examples=100)
@given(full_of_borrowers(whole_nodes=True))
def test_guarantee_is_reached_from_whole_node_borrowers_that_leave(case: Reclaim) -> None:
    """What holds today: borrowers on whole nodes, victims that do not come back."""
    granted = case.granted_at(requeue_preempted=False)
    assert granted is not None and granted <= case.bound(), (granted, case.bound())


@st.composite
def without_guarantees(draw: st.DrawFn) -> Scenario:
    """No guarantees, so no reclaiming (ceilings, drains, failures and backfill remain)."""
    scenario = draw(scenarios())
    config = scenario.state.config
    queues = [q.model_copy(update={"guaranteed_gpus": 0}) for q in config.queues]
    scenario.state.config = config.model_copy(update={"queues": queues})
    return scenario


@settings(SETTINGS, max_examples=60)
@given(without_guarantees())
def test_no_request_starves_in_a_finite_stream(scenario: Scenario) -> None:
    """Every request is granted unless it never can be, and then it waits saying why.

    Guarantees are off: reclaiming can loop forever (test_guarantee_is_reached_...)."""
    sim = run_to_end(scenario)
    assert sim.quiescent(), f"still busy at {sim.now}: {sim.state.allocations}"
    config = sim.state.config
    reasons = {w.run_id: w.reason for w in sim.state.waiting}
    capacity = idle_capacity(sim.state)
    for req in sim.state.queue:
        quota = check(config, {}, req)
        if not quota.allowed:  # beyond a ceiling even on an idle cluster
            assert reasons[req.run_id] == quota.reason
        else:
            placed = place(req, capacity)
            if placed is None:
                assert reasons[req.run_id].endswith(NEVER_FITS), reasons[req.run_id]
                continue
            # It fits an idle cluster only on whole nodes bigger than it asked for, and booking
            # those would break a ceiling: waiting forever, saying so, is right.
            held = sum(capacity.info[n].gpus for n in placed) if req.nodes > 1 else req.gpus
            assert not check(config, {}, req, held).allowed, (
                f"{req.run_id} could run but never did: {reasons.get(req.run_id)}"
            )
            assert "ceiling" in reasons[req.run_id], reasons[req.run_id]
    granted = {t.run_id for t in sim.log if t.kind == "grant"}
    queued = {r.run_id for r in sim.state.queue}
    assert {a.request.run_id for a in scenario.arrivals} <= granted | queued


@dataclass
class Stream:
    scenario: Scenario
    big: Arrival
    bound: timedelta


@st.composite
def big_behind_small_jobs(draw: st.DrawFn) -> Stream:
    """A whole-cluster gang at priority 0 behind an endless stream of single-node jobs at P.

    The bound. Small jobs run at most R (their max runtime) and arrive at least R / (N - 1)
    apart on N nodes, so at most N - 1 exist at once: each is placed when it arrives, or waits
    for the big gang's reservation (< R + a tick). With aging_s > R + 2 ticks no small job ever
    ages a level, so once the big gang has waited (P + 1) * aging_s its effective priority
    P + 1 beats every small job's P: from the next pass (at most a tick later) it is first in
    line and reserves every node from the latest expected end of what runs (at most R later).
    Only jobs that end before that start may backfill, so it never moves. Hence the big gang
    starts within (P + 1) * aging_s + R + TICK of its submission.
    """
    count = draw(st.integers(2, 8))
    gpus = draw(st.sampled_from(GPU_COUNTS))
    pods = draw(st.integers(1, 2))
    nodes = [node(f"n{i:02d}", pod=f"p{i % pods}", gpus=gpus) for i in range(count)]
    small_runtime = draw(st.floats(300, 1800))
    aging_s = draw(st.floats(small_runtime + 2 * TICK.total_seconds() + 1, 3600))
    priority = draw(st.integers(1, 3))
    bound = timedelta(seconds=(priority + 1) * aging_s + small_runtime) + TICK
    spacing = small_runtime / (count - 1) * draw(st.floats(1.0, 1.5))
    smalls = [
        Arrival(
            k * spacing,
            request(
                f"small{k:04d}",
                gpus_per_node=draw(st.sampled_from([g for g in GPU_COUNTS if g <= gpus])),
                team="interactive",
                priority=priority,
                max_runtime_s=small_runtime,
                submitted_at=None,
            ),
        )
        for k in range(int(bound.total_seconds() / spacing) + 2)
    ]
    big = Arrival(
        draw(st.floats(0, spacing)),
        request("big", nodes=count, gpus_per_node=gpus, team="batch", max_runtime_s=3600),
    )
    scenario = Scenario(
        state=ClusterState(config=ClusterConfig(aging_s=aging_s), nodes=nodes),
        arrivals=[*smalls, big],
        seed=draw(st.integers(0, 2**16)),
    )
    return Stream(scenario, big, bound)


@settings(SETTINGS, max_examples=150)
@given(big_behind_small_jobs())
def test_a_big_low_priority_gang_starts_within_the_aging_bound(stream: Stream) -> None:
    sim = stream.scenario.simulator(on_decisions=assert_whole_gangs)
    submitted = NOW + timedelta(seconds=stream.big.at_s)
    sim.run(until=submitted + stream.bound, stop=lambda s: s.granted_at("big") is not None)
    granted = sim.granted_at("big")
    assert granted is not None and granted - submitted <= stream.bound, (granted, stream.bound)


@st.composite
def held_reservations(draw: st.DrawFn) -> tuple[ClusterState, GangRequest]:
    """A full cluster of one-node gangs ending at drawn times; `old` has waited past the
    guard's limit and asks for some of the nodes; `newcomer`, higher in priority, the same."""
    count = draw(st.integers(2, 12))
    state = ClusterState(config=teams(a=(0, None)), nodes=[node(f"n{i:02d}") for i in range(count)])
    for i in range(count):
        running(state, f"r{i:02d}", [f"n{i:02d}"], team="a", hours_left=draw(st.floats(0.1, 9)))
    size = draw(st.integers(1, count // 2))
    old = request("old", nodes=size, team="a", submitted_at=NOW - timedelta(hours=7))
    state.queue = [old]
    # Above `old`, whose 7 h of aging are worth 7 priority levels: the newcomer is first in line.
    newcomer = request("newcomer", nodes=size, team="a", priority=draw(st.integers(8, 20)))
    return state, newcomer


@settings(SETTINGS, max_examples=60)
@given(held_reservations())
def test_a_reservation_holds_when_a_more_urgent_request_arrives(
    case: tuple[ClusterState, GangRequest],
) -> None:
    """Remade every pass, a reservation went to whoever was first in line that pass, and a
    long-waiting gang's start slipped pass after pass (the starvation guard keeps it)."""
    state, newcomer = case
    first = schedule(state, NOW)
    apply(state, first, NOW)
    (made,) = first.reservations
    state.queue.append(newcomer)
    later = NOW + TICK
    second = schedule(state, later)
    kept = {r.run_id: r for r in second.reservations}
    assert sorted(kept["old"].nodes) == sorted(made.nodes) and kept["old"].start == made.start
    assert not set(kept["old"].nodes) & set(kept["newcomer"].nodes)
    for granted, nodes in second.grants:  # nothing starts on them that would outlast the start
        assert (
            not set(nodes) & set(made.nodes)
            or later + timedelta(seconds=granted.max_runtime_s or 0) <= made.start
        )
