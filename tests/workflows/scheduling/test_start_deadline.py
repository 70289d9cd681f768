"""A request that has waited past `reserve_after_s` starts by `start_within_s` after its
submission: its reservation is held to that time, and at that time the gangs still on its nodes
give them back, unless they outrank it."""

from __future__ import annotations

from datetime import timedelta

import pytest
from pydantic import ValidationError

from tests.workflows.scheduling.policy_fixtures import NOW, node, request, running
from tests.workflows.scheduling.simulation import TICK, Arrival, Simulator
from workflows.contracts.cluster_models import ClusterConfig, ClusterState, QueueConfig
from workflows.scheduling.policy_switches import Switches
from workflows.scheduling.scheduler import schedule

LIMIT_H = 20.0


def busy_cluster() -> ClusterState:
    """Four nodes: two idle, two running gangs with 30 h left to their declared max runtime."""
    config = ClusterConfig(start_within_s=LIMIT_H * 3600)
    state = ClusterState(config=config, nodes=[node(f"n{i}") for i in range(4)])
    running(state, "long0", ["n0"], hours_left=30)
    running(state, "long1", ["n1"], hours_left=30)
    return state


def test_backfill_on_the_reserved_nodes_must_end_by_the_deadline() -> None:
    state = busy_cluster()
    big = request("big", nodes=4, submitted_at=NOW - timedelta(hours=7))
    state.queue = [
        big,
        request("ends-after", max_runtime_s=14 * 3600),
        request("ends-before", max_runtime_s=12 * 3600),
    ]
    # Backfill that must end first; yielders, which leave when told, are test_yielding_backfill's.
    decisions = schedule(state, NOW, Switches(yielding_backfill=False))
    (held,) = [r for r in decisions.reservations if r.run_id == "big"]
    assert held.start == NOW + timedelta(hours=LIMIT_H - 7)  # not NOW + 30 h
    assert [r.run_id for r, _ in decisions.grants] == ["ends-before"]
    assert not decisions.preemptions  # the deadline has not come
    # With yielders, the one that would end after the deadline runs too, as a yielder.
    assert schedule(state, NOW).yielding == {"ends-after": "big"}

    # The guard as it was: the reservation waits for the declared ends, and both backfill.
    before = schedule(state, NOW, Switches(start_deadline=False))
    (held,) = [r for r in before.reservations if r.run_id == "big"]
    assert held.start == NOW + timedelta(hours=30)
    assert sorted(r.run_id for r, _ in before.grants) == ["ends-after", "ends-before"]


def test_at_the_deadline_the_gangs_on_its_nodes_give_them_back() -> None:
    state = busy_cluster()
    state.queue = [request("big", nodes=4, submitted_at=NOW - timedelta(hours=21))]
    decisions = schedule(state, NOW)
    victims = dict(decisions.preemptions)
    assert sorted(victims) == ["long0", "long1"]
    notice = victims["long0"]
    assert notice.for_run == "big" and notice.reason == "holds nodes reserved for big, waiting 21 h"
    assert notice.deadline == NOW + timedelta(seconds=state.config.preemption_grace_s)


def test_the_deadline_spares_gangs_that_outrank_it_and_runs_that_started_before() -> None:
    state = busy_cluster()
    state.allocations[0].priority = 1  # outranks the request
    state.allocations[1].preemptible = False
    state.queue = [request("big", nodes=4, submitted_at=NOW - timedelta(hours=21))]
    assert not schedule(state, NOW).preemptions

    # A run requeued before requeued runs had deadlines (no `waiting_since`) waits by its age,
    # as it did then.
    state = busy_cluster()
    state.queue = [
        request("big", nodes=4, submitted_at=NOW - timedelta(hours=21), started_before=True)
    ]
    decisions = schedule(state, NOW)
    assert not decisions.preemptions
    assert decisions.reservations[0].start == NOW + timedelta(hours=30)


def test_a_requeued_run_starts_by_its_deadline_counted_from_the_requeue() -> None:
    """Not from its first submission (a victim would evict others at once) and not never (a
    big run that failed waited 30.9 h in simulation for its nodes to come back)."""
    state = busy_cluster()
    requeued = request("big", nodes=4, submitted_at=NOW - timedelta(days=3), started_before=True)
    state.queue = [requeued.model_copy(update={"waiting_since": NOW - timedelta(hours=2)})]
    decisions = schedule(state, NOW, Switches(yielding_backfill=False))
    assert not decisions.preemptions  # a first-submission deadline would have passed long ago
    (held,) = decisions.reservations
    assert held.start == NOW + timedelta(hours=LIMIT_H - 2)  # not NOW + 30 h

    state.queue = [requeued.model_copy(update={"waiting_since": NOW - timedelta(hours=21)})]
    victims = dict(schedule(state, NOW).preemptions)
    assert sorted(victims) == ["long0", "long1"]
    assert victims["long0"].reason == "holds nodes reserved for big, waiting 21 h"


def test_a_gang_behind_long_runs_starts_by_its_deadline_and_they_resume_after() -> None:
    """Through the passes the Cluster workflow runs: the victims save and give back within
    their grace, the gang starts, and the victims queue again, now as runs that ran before."""
    state = ClusterState(
        config=ClusterConfig(start_within_s=LIMIT_H * 3600),
        nodes=[node(f"n{i}") for i in range(4)],
    )
    for i in range(4):
        running(state, f"long{i}", [f"n{i}"], hours_left=40)
    big = request("big", nodes=4, submitted_at=None, max_runtime_s=3600)
    sim = Simulator(state, [Arrival(0.0, big)], seed=1)
    sim.run(until=NOW + timedelta(hours=30), stop=lambda s: s.granted_at("big") is not None)
    granted = sim.granted_at("big")
    grace = timedelta(seconds=state.config.preemption_grace_s)
    assert granted is not None
    assert (
        NOW + timedelta(hours=LIMIT_H) <= granted <= NOW + timedelta(hours=LIMIT_H) + grace + TICK
    )
    preempted = sorted(t.run_id for t in sim.log if t.kind == "preempt")
    assert preempted == ["long0", "long1", "long2", "long3"]
    assert all(sim.requests[f"long{i}"].started_before for i in range(4))


def test_a_deadline_before_the_reservation_is_refused_with_the_fix() -> None:
    with pytest.raises(ValidationError, match=r"start_within_s \(3600\) is shorter than reserve_"):
        ClusterConfig(reserve_after_s=7200, start_within_s=3600)


def test_a_reclaim_earlier_in_the_pass_does_not_turn_the_deadline_on() -> None:
    """With the deadline off (histories recorded before it, the simulator's older policies), a
    reservation waits for the declared ends, also when a request before it in the same pass
    reclaimed its team's guarantee (the reclaim's grace deadline once took the switch's name)."""
    config = ClusterConfig(
        start_within_s=LIMIT_H * 3600,
        queues=[
            QueueConfig(name="a", guaranteed_gpus=8),
            QueueConfig(name="b", guaranteed_gpus=24),
        ],
    )
    state = ClusterState(config=config, nodes=[node(f"n{i}") for i in range(4)])
    for i in range(4):
        running(state, f"long{i}", [f"n{i}"], team="b", hours_left=30)
    state.queue = [
        request("reclaimer", team="a", priority=10, submitted_at=NOW - timedelta(hours=1)),
        request("big", nodes=4, team="b", submitted_at=NOW - timedelta(hours=7)),
    ]
    before = schedule(state, NOW, Switches(start_deadline=False))
    assert [notice.for_run for _, notice in before.preemptions] == ["reclaimer"]
    (held,) = before.reservations
    assert (held.run_id, held.start) == ("big", NOW + timedelta(hours=30))
    # With the deadline on, the same pass holds it to the deadline.
    (held,) = schedule(state, NOW).reservations
    assert held.start == NOW + timedelta(hours=LIMIT_H - 7)
