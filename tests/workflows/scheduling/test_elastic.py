"""Elastic gangs in the scheduling policy: shrink after a failure, grow back when free."""

from __future__ import annotations

from datetime import timedelta

from tests.workflows.scheduling.policy_fixtures import NOW, node, request, running, teams
from workflows.contracts.cluster_models import ClusterConfig, ClusterState
from workflows.contracts.names import PREEMPT_SIGNAL
from workflows.scheduling.cluster_ops import free, run_pass
from workflows.scheduling.scheduler import schedule


def test_a_recovering_elastic_gang_takes_what_is_left_down_to_min_nodes() -> None:
    state = ClusterState(nodes=[node("n0"), node("n1")])
    state.queue = [request("r", nodes=3, min_nodes=1, recovery=True)]
    decisions = schedule(state, NOW)
    ((granted, nodes),) = decisions.grants
    assert (granted.nodes, sorted(nodes)) == (2, ["n0", "n1"])
    assert decisions.shrunk["r"].nodes == 3  # what it grows back to

    # Below min_nodes it waits; without min_nodes, or when merely queued, it never shrinks.
    for asked in (
        request("r", nodes=3, min_nodes=3, recovery=True),
        request("r", nodes=3, recovery=True),
        request("r", nodes=3, min_nodes=1),
    ):
        state.queue = [asked]
        assert schedule(state, NOW).grants == [], asked


def test_the_full_gang_wins_when_it_fits() -> None:
    state = ClusterState(nodes=[node("n0"), node("n1"), node("n2")])
    state.queue = [request("r", nodes=3, min_nodes=1, recovery=True)]
    decisions = schedule(state, NOW)
    assert [len(nodes) for _, nodes in decisions.grants] == [3]
    assert decisions.shrunk == {}


def test_the_shrunk_allocation_remembers_its_full_request() -> None:
    state = ClusterState(nodes=[node("n0"), node("n1")])
    state.queue = [request("r", nodes=3, min_nodes=2, recovery=True)]
    run_pass(state, NOW)
    (allocation,) = state.allocations
    assert len(allocation.nodes) == 2
    assert allocation.wanted is not None and allocation.wanted.nodes == 3


def test_a_shrunk_gang_grows_back_onto_claimed_nodes() -> None:
    state = ClusterState(nodes=[node("n0"), node("n1"), node("n2")])
    wanted = request("r", nodes=2, min_nodes=1, recovery=True)
    shrunk = running(state, "r", ["n0"], wanted=wanted)
    _, decisions, messages = run_pass(state, NOW)
    ((victim, notice),) = decisions.preemptions
    assert (victim, notice.grow_to, notice.reason) == ("r", 2, "grows back to 2 nodes")
    ((run_id, signal, sent),) = messages
    assert (run_id, signal, sent.grow_to) == ("r", PREEMPT_SIGNAL, 2)
    (claim,) = state.claims
    assert "n0" in claim.nodes and len(claim.nodes) == 2

    # While it checkpoints (not queued) a newcomer cannot take the claimed free node...
    state.queue = [request("newcomer")]
    soon = NOW + timedelta(seconds=5)
    _, decisions, _ = run_pass(state, soon)
    (spare_node,) = set(claim.nodes) - {"n0"}
    assert all(spare_node not in nodes for _, nodes in decisions.grants)
    # ...and once it releases and queues again, it is granted the full gang there.
    free(state, shrunk, soon)
    state.queue.append(request("r", nodes=2, min_nodes=1))
    _, decisions, _ = run_pass(state, soon)
    grants = {r.run_id: sorted(nodes) for r, nodes in decisions.grants}
    assert grants["r"] == sorted(claim.nodes)
    regrown = next(a for a in state.allocations if a.run_id == "r")
    assert regrown.wanted is None


def test_the_queue_comes_before_growing_back_and_spares_are_not_grown_onto() -> None:
    state = ClusterState(nodes=[node("n0"), node("n1")])
    running(state, "r", ["n0"], wanted=request("r", nodes=2, min_nodes=1, recovery=True))
    state.queue = [request("waiting")]
    decisions = schedule(state, NOW)
    assert [nodes for _, nodes in decisions.grants] == [["n1"]]
    assert decisions.preemptions == []

    spared = ClusterState(nodes=[node("n0"), node("n1")], config=ClusterConfig(spare_nodes=1))
    running(spared, "r", ["n0"], wanted=request("r", nodes=2, min_nodes=1, recovery=True))
    assert schedule(spared, NOW).preemptions == []


def test_growing_back_stays_within_the_teams_ceiling() -> None:
    state = ClusterState(nodes=[node("n0"), node("n1")], config=teams(t=(0, 8)))
    wanted = request("r", nodes=2, min_nodes=1, recovery=True, team="t")
    running(state, "r", ["n0"], team="t", wanted=wanted)
    assert schedule(state, NOW).preemptions == []
