"""The scheduling policy, example by example (properties live in test_policy_properties)."""

from __future__ import annotations

from datetime import datetime, timedelta

from tests.workflows.scheduling.policy_fixtures import NOW, node, request, running, teams
from workflows.contracts.cluster_models import (
    Admin,
    ClusterConfig,
    ClusterState,
    Health,
    Reservation,
)
from workflows.scheduling.placement import Capacity, place
from workflows.scheduling.policy_switches import Switches
from workflows.scheduling.quotas import borrowed, check, decay_usage, in_use
from workflows.scheduling.scheduler import choose_spares, schedule


def capacity(*nodes) -> Capacity:
    return Capacity((n.info, n.free) for n in nodes)


def test_gang_is_all_or_nothing_and_stays_in_the_smallest_pod_that_holds_it() -> None:
    nodes = [node(f"a{i}", "big") for i in range(4)] + [node(f"b{i}", "small") for i in range(2)]
    assert place(request("r", nodes=2), capacity(*nodes)) == ["b0", "b1"]
    assert place(request("r", nodes=7), capacity(*nodes)) is None
    # Across pods only when no pod holds it, and only if allowed: fewest pods, biggest first.
    assert place(request("r", nodes=5), capacity(*nodes)) == ["a0", "a1", "a2", "a3", "b0"]
    assert place(request("r", nodes=5, allow_multi_pod=False), capacity(*nodes)) is None


def test_single_node_jobs_take_the_best_fit_and_leave_whole_nodes_whole() -> None:
    half, whole = node("half"), node("whole")
    half.jobs["other"] = 4
    assert place(request("r", gpus_per_node=2), capacity(half, whole)) == ["half"]
    assert place(request("r", gpus_per_node=8), capacity(half, whole)) == ["whole"]
    assert place(request("r", gpus_per_node=2, gpu_type="a100"), capacity(half, whole)) is None


def test_nodes_holding_the_runs_data_win_ties() -> None:
    nodes = [node("n0"), node("n1", cached=["snap"]), node("n2"), node("n3", cached=["snap"])]
    assert place(request("r", nodes=2, cache_items=["snap"]), capacity(*nodes)) == ["n1", "n3"]
    assert place(request("r", gpus_per_node=8, cache_items=["snap"]), capacity(*nodes)) == ["n1"]


def test_quotas_guarantee_ceiling_and_borrowing() -> None:
    config = teams(nlp=(16, 24), vision=(8, None))
    state = ClusterState(config=config, nodes=[node(f"n{i}") for i in range(6)])
    running(state, "a", ["n0", "n1"], team="nlp")  # 16: exactly nlp's guarantee
    used = in_use(config, state.allocations)
    assert check(config, used, request("b", team="nlp")).borrowing  # 24 > 16
    refused = check(config, used, request("c", nodes=2, team="nlp"))  # 32 > 24
    assert not refused.allowed and "max_gpus 24" in refused.reason
    rigid = check(config, used, request("d", team="nlp", preemptible=False))
    assert not rigid.allowed and "only preemptible jobs may borrow" in rigid.reason
    running(state, "e", ["n2"], team="nlp")
    assert borrowed(config, state.allocations) == {"e"}  # the younger grant is the borrower


def test_a_teams_higher_priority_gang_fills_its_guarantee_first() -> None:
    """A high-priority run that just restarted is the team's newest grant; were it the borrower
    it would be the next victim again (in simulation a 4,096-GPU run was preempted 110 times)."""
    config = teams(nlp=(16, None), vision=(8, None))
    state = ClusterState(config=config, nodes=[node(f"n{i}") for i in range(4)])
    running(state, "small", ["n0"], team="nlp")
    restarted = running(state, "big", ["n1", "n2"], team="nlp", priority=1)
    restarted.granted_at = NOW
    assert borrowed(config, state.allocations) == {"small"}


def test_the_node_index_follows_nodes_that_join() -> None:
    state = ClusterState(nodes=[node("n0")])
    assert state.node("n0") is state.nodes[0] and state.node("n1") is None
    state.nodes.append(node("n1"))  # a node agent registers
    assert state.node("n1") is state.nodes[1]
    state.nodes = [node("n1")]  # replaced wholesale (as a continued-as-new state)
    assert state.node("n1") is state.nodes[0] and state.node("n0") is None


def test_a_team_reclaims_its_guarantee_from_the_cheapest_borrower() -> None:
    config = teams(nlp=(16, None), vision=(0, None))
    state = ClusterState(config=config, nodes=[node(f"n{i}") for i in range(3)])
    running(state, "recent-ckpt", ["n0"], team="vision", checkpoint_minutes_ago=1)
    running(state, "stale-ckpt", ["n1"], team="vision", checkpoint_minutes_ago=50)
    running(state, "rigid", ["n2"], team="vision", preemptible=False)
    state.queue = [request("nlp-job", team="nlp", submitted_at=patient_since(config))]
    decisions = schedule(state, NOW)
    assert decisions.grants == []
    assert [victim for victim, _ in decisions.preemptions] == ["recent-ckpt"]
    notice = decisions.preemptions[0][1]
    assert notice.for_run == "nlp-job" and notice.deadline == NOW + timedelta(seconds=120)
    assert "preempting recent-ckpt" in decisions.waiting[0].reason


def patient_since(config: ClusterConfig) -> datetime:
    """A submission that has waited its `reclaim_after_s` at NOW."""
    return NOW - timedelta(seconds=config.reclaim_after_s)


def test_a_team_waits_for_nodes_to_free_before_it_reclaims() -> None:
    """On a big cluster some gang ends every minute or so: in three weeks of simulation,
    waiting a quarter of an hour for nodes to free on their own cut the reclaims from 650 to
    406. A request within its guarantee waits `reclaim_after_s` before it preempts."""
    config = teams(nlp=(8, None), vision=(0, None))
    state = ClusterState(config=config, nodes=[node("n0")])
    running(state, "borrower", ["n0"], team="vision", checkpoint_minutes_ago=20)
    state.queue = [request("nlp-job", team="nlp")]  # submitted now
    decisions = schedule(state, NOW)
    assert decisions.preemptions == []
    (waiting,) = decisions.waiting
    assert waiting.reason.endswith("it reclaims from borrowers at 12:15:00 UTC"), waiting.reason
    almost = NOW + timedelta(seconds=config.reclaim_after_s - 1)
    assert schedule(state, almost).preemptions == []
    later = NOW + timedelta(seconds=config.reclaim_after_s)
    assert [v for v, _ in schedule(state, later).preemptions] == ["borrower"]
    # The policy before (histories recorded then replay with it) reclaims at once.
    before = schedule(state, NOW, Switches(reclaim_patience=False))
    assert [v for v, _ in before.preemptions] == ["borrower"]


def test_a_requeued_run_reclaims_at_once() -> None:
    """It keeps its first submission: its wait stalls work already under way."""
    config = teams(nlp=(8, None), vision=(0, None))
    state = ClusterState(config=config, nodes=[node("n0")])
    running(state, "borrower", ["n0"], team="vision", checkpoint_minutes_ago=20)
    ran = request("nlp-job", team="nlp", submitted_at=NOW - timedelta(hours=3))
    state.queue = [ran.model_copy(update={"started_before": True, "waiting_since": NOW})]
    assert [v for v, _ in schedule(state, NOW).preemptions] == ["borrower"]


def test_borrowers_are_never_taken_for_another_borrower() -> None:
    config = teams(nlp=(0, None), vision=(0, None))
    state = ClusterState(config=config, nodes=[node("n0")])
    running(state, "v", ["n0"], team="vision")
    state.queue = [request("n", team="nlp")]  # nlp has no guarantee: it only borrows
    decisions = schedule(state, NOW)
    assert decisions.preemptions == [] and decisions.grants == []


def test_head_of_line_reservation_and_backfill() -> None:
    state = ClusterState(nodes=[node(f"n{i}") for i in range(4)])
    running(state, "long", ["n0", "n1"], hours_left=5)
    running(state, "short", ["n2"], hours_left=1)
    state.queue = [
        request("big", nodes=3, submitted_at=NOW - timedelta(minutes=30)),
        request("fits-before", max_runtime_s=1800),  # 30 min, before the reservation
        request("too-long", max_runtime_s=7200, submitted_at=NOW + timedelta(seconds=1)),
    ]
    decisions = schedule(state, NOW)
    reservation = decisions.reservation
    assert reservation is not None and reservation.run_id == "big"
    # "short" ends in 1 h and frees n2; with n3 that is 2 nodes: not enough for 3, so the
    # reservation waits for "long" (5 h).
    assert reservation.start == NOW + timedelta(hours=5)
    assert [r.run_id for r, _ in decisions.grants] == ["fits-before"]
    assert {w.run_id: w.reason for w in decisions.waiting}["too-long"].startswith("no capacity")


def test_priority_then_aging_orders_the_queue() -> None:
    state = ClusterState(nodes=[node("n0")], config=ClusterConfig(aging_s=900))
    state.queue = [
        request("old-low", priority=0, submitted_at=NOW - timedelta(minutes=59)),
        request("new-high", priority=5, submitted_at=NOW),
    ]
    # 59 minutes at one level per 15: effective priority 3 < 5.
    assert [r.run_id for r, _ in schedule(state, NOW).grants] == ["new-high"]
    # 90 minutes: 6 levels > 5 (new-high, resubmitted now, has not aged).
    later = NOW + timedelta(minutes=31)
    state.queue[1] = request("new-high", priority=5, submitted_at=later)
    assert [r.run_id for r, _ in schedule(state, later).grants] == ["old-low"]


def test_spares_are_held_back_for_recovery() -> None:
    state = ClusterState(nodes=[node("n0"), node("n1")], config=ClusterConfig(spare_nodes=1))
    assert choose_spares(state.nodes, 1) == {"n1"}
    state.queue = [request("a", nodes=2)]
    assert schedule(state, NOW).grants == []  # one node is a spare
    state.queue = [request("a", nodes=2, recovery=True)]
    ((_, nodes),) = schedule(state, NOW).grants
    assert sorted(nodes) == ["n0", "n1"]


def reserved_while_the_pool_is_short() -> ClusterState:
    """One spare wanted and none held; the only idle nodes, n1 and n2, are held with n3 for
    `big`, waiting 7 h (past `reserve_after_s`), until the gang on n3 ends."""
    state = ClusterState(
        nodes=[node(f"n{i}") for i in range(4)], config=ClusterConfig(spare_nodes=1)
    )
    running(state, "elsewhere", ["n0"], hours_left=9)
    running(state, "on-n3", ["n3"], hours_left=2)
    state.reservations = [Reservation(run_id="big", nodes=["n1", "n2", "n3"], start=NOW)]
    state.queue = [request("big", nodes=3, submitted_at=NOW - timedelta(hours=7))]
    return state


def test_the_spare_pool_does_not_refill_from_nodes_a_reservation_holds() -> None:
    decisions = schedule(reserved_while_the_pool_is_short(), NOW)
    assert decisions.spares == set()  # short until a node no one holds frees
    (held,) = decisions.reservations
    assert (held.run_id, held.nodes, held.start) == (
        "big",
        ["n1", "n2", "n3"],
        NOW + timedelta(hours=2),
    )

    # The policy before (histories recorded then replay with it): the pool took a reserved
    # idle node, so the reservation no longer stood and was made again elsewhere, later.
    before = Switches(spares_off_reservations=False)
    decisions = schedule(reserved_while_the_pool_is_short(), NOW, before)
    assert decisions.spares == {"n2"}
    (remade,) = decisions.reservations
    assert remade.start == NOW + timedelta(hours=9)


def test_draining_node_preempts_its_gang_and_down_nodes_are_skipped() -> None:
    state = ClusterState(nodes=[node("n0"), node("n1"), node("n2")])
    running(state, "victim", ["n0"])
    state.nodes[0].admin = Admin.DRAINING
    state.nodes[1].health = Health.DOWN
    state.queue = [request("new")]
    decisions = schedule(state, NOW)
    assert [(v, p.reason) for v, p in decisions.preemptions] == [("victim", "node n0 is draining")]
    assert [n for _, n in decisions.grants] == [["n2"]]


def test_usage_decays_by_half_life() -> None:
    state = ClusterState(nodes=[node("n0")])
    allocation = running(state, "a", ["n0"])
    usage = decay_usage({"default": 1000.0}, NOW, NOW + timedelta(hours=1), 3600, [allocation])
    assert usage["default"] == 500.0 + 8 * 3600


# --- the starvation guard (Switches.starvation_guard); False is the policy before it ---------


def _freed_one_node_at_a_time() -> ClusterState:
    """n0 just came free, n1 frees in an hour; the head of the line (`first`, higher priority)
    is reserved the a100 nodes; `old` (2 nodes) has waited 7 h, past the guard's 6 h; `young`
    (one node, 10 h) arrived just now and fits n0."""
    nodes = [node("n0"), node("n1"), node("m0", gpu_type="a100"), node("m1", gpu_type="a100")]
    state = ClusterState(config=teams(a=(0, None)), nodes=nodes)
    running(state, "x", ["n1"], team="a", hours_left=1)
    running(state, "y", ["m0", "m1"], team="a", hours_left=2)
    state.queue = [
        request("first", nodes=2, team="a", priority=9, gpu_type="a100"),
        request("old", nodes=2, team="a", submitted_at=NOW - timedelta(hours=7)),
        request("young", team="a", max_runtime_s=10 * 3600),
    ]
    return state


def test_a_long_waiting_gang_keeps_the_nodes_freed_for_it() -> None:
    """Not the head of the line, a big gang used to watch every node that freed go to younger,
    smaller jobs (in simulation 1,024-GPU gangs waited up to 45 h while 8-GPU jobs started)."""
    state = _freed_one_node_at_a_time()
    before = schedule(state, NOW, Switches(starvation_guard=False))
    assert [(r.run_id, nodes) for r, nodes in before.grants] == [("young", ["n0"])]
    # `young` would hold n0 for 10 h, past the reservation's start: it may not backfill there,
    # only run as a yielder (workflows.scheduling.yielding) that leaves when `old` can start.
    assert schedule(state, NOW, Switches(yielding_backfill=False)).grants == []
    decisions = schedule(state, NOW)
    assert [(r.run_id, nodes) for r, nodes in decisions.grants] == [("young", ["n0"])]
    assert decisions.yielding == {"young": "old"}
    assert decisions.reservation is not None and decisions.reservation.run_id == "first"
    assert [(r.run_id, sorted(r.nodes)) for r in decisions.reservations] == [
        ("first", ["m0", "m1"]),
        ("old", ["n0", "n1"]),
    ]
    assert decisions.reservations[1].start == NOW + timedelta(hours=1)


def test_a_short_job_may_still_use_a_long_waiting_gangs_nodes_until_it_starts() -> None:
    state = _freed_one_node_at_a_time()
    state.queue[2] = request("short", team="a", max_runtime_s=30 * 60)
    assert [(r.run_id, nodes) for r, nodes in schedule(state, NOW).grants] == [("short", ["n0"])]


def test_a_gang_just_granted_is_not_preempted_again() -> None:
    """The gang just granted has lost the least since its start, so it was the victim, then it
    queued again (first, by its age), was granted, and preempted again: one gang 133 times in
    three weeks of simulation."""
    config = teams(nlp=(8, None), vision=(0, None))
    state = ClusterState(config=config, nodes=[node("n0"), node("n1")])
    fresh = running(state, "fresh", ["n0"], team="vision", checkpoint_minutes_ago=1)
    fresh.granted_at = NOW - timedelta(minutes=10)
    running(state, "settled", ["n1"], team="vision", checkpoint_minutes_ago=20)
    state.queue = [request("reclaimer", team="nlp", submitted_at=patient_since(config))]
    victims = {v for v, _ in schedule(state, NOW, Switches(starvation_guard=False)).preemptions}
    assert victims == {"fresh"}
    assert {v for v, _ in schedule(state, NOW).preemptions} == {"settled"}
    # Past the shield it may be preempted again.
    later = NOW + timedelta(seconds=config.preemption_shield_s)
    state.allocations[1].preemptible = False
    assert {v for v, _ in schedule(state, later).preemptions} == {"fresh"}


def test_a_big_gang_is_not_stopped_for_a_small_request_to_save_a_few_minutes() -> None:
    """A victim repeats its restart too: a 4-node gang that saved a minute ago loses more than
    a one-node job that saved twenty minutes ago."""
    config = teams(nlp=(8, None), vision=(0, None))
    state = ClusterState(config=config, nodes=[node(f"n{i}") for i in range(5)])
    running(state, "big", ["n0", "n1", "n2", "n3"], team="vision", checkpoint_minutes_ago=1)
    running(state, "small", ["n4"], team="vision", checkpoint_minutes_ago=20)
    state.queue = [request("reclaimer", team="nlp", submitted_at=patient_since(config))]
    before = schedule(state, NOW, Switches(starvation_guard=False))
    assert {v for v, _ in before.preemptions} == {"big"}
    assert {v for v, _ in schedule(state, NOW).preemptions} == {"small"}
