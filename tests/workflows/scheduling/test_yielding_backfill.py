"""Yielding backfill: a preemptible request that fits nowhere else runs on a long-waiting
request's reserved nodes, and leaves (preempted, with its grace) when that reservation is
about to start; the reservation is planned as if it were not there."""

from __future__ import annotations

from datetime import timedelta

from tests.workflows.scheduling.policy_fixtures import NOW, node, request, running
from tests.workflows.scheduling.simulation import TICK, Arrival, Simulator
from workflows.contracts.cluster_models import ClusterConfig, ClusterState, Reservation
from workflows.scheduling import cluster_ops as ops
from workflows.scheduling.policy_switches import Switches
from workflows.scheduling.scheduler import schedule

LIMIT_H = 20.0


def reserved_for_big(hours_left: float, big_runtime_s: float | None = None) -> ClusterState:
    """Four nodes, two of them running gangs with `hours_left` to their declared max runtime,
    and a four-node request waiting 7 h: past `reserve_after_s` (6 h), so its reservation holds
    the two idle nodes from pass to pass."""
    state = ClusterState(
        config=ClusterConfig(start_within_s=LIMIT_H * 3600),
        nodes=[node(f"n{i}") for i in range(4)],
    )
    running(state, "long0", ["n0"], hours_left=hours_left)
    running(state, "long1", ["n1"], hours_left=hours_left)
    big = request(
        "big", nodes=4, submitted_at=NOW - timedelta(hours=7), max_runtime_s=big_runtime_s
    )
    state.queue = [big]
    return state


def test_a_preemptible_request_takes_reserved_idle_nodes_as_a_yielder() -> None:
    state = reserved_for_big(hours_left=30)
    state.queue += [
        request("pinned", max_runtime_s=14 * 3600, preemptible=False),
        request("yields", max_runtime_s=14 * 3600),
    ]
    decisions = schedule(state, NOW)
    # It does not end before the reservation starts (the deadline, 13 h away): only as a
    # yielder may it run there. A run that may not be preempted cannot promise to leave.
    assert [r.run_id for r, _ in decisions.grants] == ["yields"]
    assert decisions.yielding == {"yields": "big"}
    assert "pinned" in {w.run_id for w in decisions.waiting}

    ops.apply(state, decisions, NOW)
    (granted,) = [a for a in state.allocations if a.run_id == "yields"]
    assert granted.yields_to == "big"
    assert granted.nodes[0].node_id in {"n2", "n3"}

    # The policy before it (histories recorded then replay with it): the nodes stay idle.
    state = reserved_for_big(hours_left=30)
    state.queue.append(request("yields", max_runtime_s=14 * 3600))
    assert not schedule(state, NOW, Switches(yielding_backfill=False)).grants


def test_the_yielder_is_told_to_leave_as_the_reservation_is_about_to_start() -> None:
    state = reserved_for_big(hours_left=30)
    state.queue.append(request("yields", max_runtime_s=14 * 3600))
    ops.apply(state, schedule(state, NOW), NOW)

    # One pass a grace period before the deadline: the reservation still starts then (the
    # yielder's declared end, 14 h from now, does not move it), and the yielder gets its notice
    # now, so it has saved and gone by then; the gangs it does not outrank wait for the deadline.
    grace = timedelta(seconds=state.config.preemption_grace_s)
    start = NOW + timedelta(hours=LIMIT_H - 7)
    later = start - grace / 2
    decisions = schedule(state, later)
    (held,) = [r for r in decisions.reservations if r.run_id == "big"]
    assert held.start == start
    notices = dict(decisions.preemptions)
    assert list(notices) == ["yields"]
    assert notices["yields"].for_run == "big"
    assert notices["yields"].reason == "yields the nodes reserved for big, which start now"
    assert notices["yields"].deadline == later + grace

    # Earlier than that it trains on undisturbed.
    assert not schedule(state, start - 3 * grace).preemptions


def test_a_yielder_runs_until_the_reserved_gang_can_start_then_queues_again() -> None:
    """Through the passes the Cluster workflow runs: the filler runs on the reserved idle
    nodes, leaves when the gangs on the other reserved nodes end, the big gang starts then, and
    the filler queues again and runs after it."""
    state = reserved_for_big(hours_left=5, big_runtime_s=3600)
    filler = request("filler", max_runtime_s=24 * 3600, submitted_at=None)
    sim = Simulator(state, [Arrival(0.0, filler)], seed=3)
    sim.run(until=NOW + timedelta(hours=12), stop=lambda s: s.quiescent())

    grants = [(t.at, t.run_id) for t in sim.log if t.kind == "grant"]
    assert grants[0] == (NOW, "filler")  # on the reserved idle nodes, at once
    (notice,) = [t for t in sim.log if t.kind == "preempt"]
    assert notice.run_id == "filler"
    assert notice.detail == "yields the nodes reserved for big, which start now"
    big = sim.granted_at("big")
    ends = NOW + timedelta(hours=5)  # long0 and long1 give their nodes back
    grace = timedelta(seconds=state.config.preemption_grace_s)
    assert big is not None and ends <= big <= ends + grace + TICK  # here: exactly at `ends`
    assert [run for at, run in grants if at > big] == ["filler"]


def test_a_node_its_reservations_owner_is_granted_is_not_also_backfilled() -> None:
    """The owner of a kept reservation fits on one of its reserved nodes plus a free one; a
    short job that ends before the reservation's start must not be put on that same node
    (it was, in the three-week simulation: the node held 16 of its 8 GPUs)."""
    state = ClusterState(config=ClusterConfig(), nodes=[node(f"n{i}") for i in range(3)])
    running(state, "x", ["n1"], hours_left=5)
    state.reservations = [Reservation(run_id="big", nodes=["n0", "n1"], start=NOW)]
    state.queue = [
        request("big", nodes=2, submitted_at=NOW - timedelta(hours=7)),
        request("short", max_runtime_s=3600),
    ]
    decisions = schedule(state, NOW)
    assert [(r.run_id, sorted(nodes)) for r, nodes in decisions.grants] == [("big", ["n0", "n2"])]
    ops.apply(state, decisions, NOW)
    assert all(n.used <= n.info.gpus for n in state.nodes)


def two_reservations() -> ClusterState:
    """Two kept reservations of two nodes, each with one node idle: `first` (older, first in
    line) starts in 3 h, when its other node's gang ends, `later` in 10 h."""
    state = ClusterState(config=ClusterConfig(), nodes=[node(f"n{i}") for i in range(4)])
    running(state, "ends-soon", ["n1"], hours_left=3)
    running(state, "ends-late", ["n3"], hours_left=10)
    state.reservations = [
        Reservation(run_id="first", nodes=["n0", "n1"], start=NOW),
        Reservation(run_id="later", nodes=["n2", "n3"], start=NOW),
    ]
    state.queue = [
        request("first", nodes=2, submitted_at=NOW - timedelta(hours=8)),
        request("later", nodes=2, submitted_at=NOW - timedelta(hours=7)),
        request("yields", max_runtime_s=14 * 3600),
    ]
    return state


def test_a_yielder_goes_to_the_reservation_that_starts_latest() -> None:
    """It fits on either reservation's idle node and ends before neither: on the one that
    starts in 10 h it trains 10 h before it is told to leave, on the other 3 h."""
    decisions = schedule(two_reservations(), NOW)
    assert {r.run_id: r.start for r in decisions.reservations} == {
        "first": NOW + timedelta(hours=3),
        "later": NOW + timedelta(hours=10),
    }
    assert [(r.run_id, nodes) for r, nodes in decisions.grants] == [("yields", ["n2"])]
    assert decisions.yielding == {"yields": "later"}

    # The policy before it (histories recorded then replay with it): the first in line.
    decisions = schedule(two_reservations(), NOW, Switches(yield_latest_first=False))
    assert [(r.run_id, nodes) for r, nodes in decisions.grants] == [("yields", ["n0"])]
    assert decisions.yielding == {"yields": "first"}
