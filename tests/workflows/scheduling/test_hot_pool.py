"""The hot pool's decisions, as pure functions of the cluster state: demand that decays, targets
that split `hot_fraction` of the nodes by demand, and warming that goes to idle nodes only, a
few a pass, the model furthest below its target first."""

from __future__ import annotations

from datetime import timedelta

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.workflows.scheduling.policy_fixtures import NOW, node, request
from workflows.contracts.cluster_models import Admin, ClusterConfig, ClusterState, Warming
from workflows.contracts.held_items import checkpoint_item
from workflows.scheduling import hot_pool

GB = 10**9


def key(name: str) -> str:
    return f"runs/{name}/checkpoints/step-100/MANIFEST.json"


def fine_tune(run: str, base: str, **fields) -> object:
    item = checkpoint_item(key(base))
    return request(run, base_model=key(base), needs={item: 10 * GB}, **fields)


def pool(nodes: int, fraction: float, **config) -> ClusterState:
    return ClusterState(
        config=ClusterConfig(hot_fraction=fraction, **config),
        nodes=[node(f"n{i}") for i in range(nodes)],
    )


def asked(state: ClusterState, base: str, times: int, at=NOW) -> None:
    for i in range(times):
        hot_pool.record_demand(state, fine_tune(f"{base}-{i}", base), at)


def test_demand_decays_and_counts_a_run_once() -> None:
    state = pool(4, 0.5, hot_half_life_h=10)
    asked(state, "a", 2)
    hot_pool.record_demand(state, fine_tune("a-0", "a", started_before=True), NOW)  # a restart
    item = checkpoint_item(key("a"))
    assert state.demand[item].weight == 2 and state.demand[item].bytes == 10 * GB
    later = NOW + timedelta(hours=10)
    assert hot_pool.hot_set(state, later) == [(item, 1.0)]
    hot_pool.record_demand(state, fine_tune("a-9", "a"), later)
    assert state.demand[item].weight == 2.0 and state.demand[item].at == later


def test_targets_split_the_fraction_by_demand_and_keep_the_most_wanted() -> None:
    state = pool(8, 0.5, hot_models=2)  # 4 nodes for the pool, two models at most
    asked(state, "a", 3)
    asked(state, "b", 1)
    asked(state, "c", 1, at=NOW - timedelta(hours=1))  # asked as often as b, but earlier
    a, b = checkpoint_item(key("a")), checkpoint_item(key("b"))
    assert hot_pool.targets(state, NOW) == {a: 3, b: 1}
    tiny = pool(1, 0.5)  # half of one node is no node
    asked(tiny, "a", 1)
    assert hot_pool.targets(tiny, NOW) == {}


def test_warming_goes_to_idle_nodes_the_model_furthest_below_its_target_first() -> None:
    state = pool(6, 1.0)
    asked(state, "a", 2)
    asked(state, "b", 4)
    a, b = checkpoint_item(key("a")), checkpoint_item(key("b"))
    state.nodes[0].info.held = {a: 10 * GB}  # a has one holder already
    state.nodes[1].jobs = {"busy": 8}  # not idle
    state.nodes[2].admin = Admin.CORDONED
    state.nodes[3].spare = True
    plan = hot_pool.warm_plan(state, NOW)
    # Targets 2 and 4: a is short of 1, b of 4. Only n4 and n5 are free to warm.
    assert [(w.node_id, w.item) for w in plan] == [("n4", b), ("n5", b)]
    assert plan[0].manifest_key == key("b")
    assert set(state.warming) == {"n4", "n5"}
    assert hot_pool.warm_plan(state, NOW) == []  # they are warming: not told twice
    # A fetch that did not finish in time is given up, and the node is planned again.
    again = hot_pool.warm_plan(state, NOW + hot_pool.WARM_TIMEOUT)
    assert {w.node_id for w in again} == {"n4", "n5"}


def test_the_pool_view_counts_holders_against_targets_and_the_disk_they_use() -> None:
    state = pool(4, 0.5)
    asked(state, "a", 1)
    a = checkpoint_item(key("a"))
    state.nodes[0].info.held = {a: 10 * GB, "5eed": GB}
    state.warming = {"n1": Warming(item=a, until=NOW + timedelta(minutes=5))}
    view = hot_pool.pool_view(state, NOW)
    assert view.models == [(a, 1, 2, 10 * GB)]
    assert (view.nodes_holding, view.schedulable, view.warming) == (1, 4, 1)
    assert view.bytes_held == 10 * GB


@settings(max_examples=100, deadline=None)
@given(
    nodes=st.integers(1, 20),
    fraction=st.floats(0.05, 1.0),
    demand=st.lists(st.integers(1, 5), min_size=1, max_size=6),
    busy=st.sets(st.integers(0, 19)),
    rounds=st.integers(1, 4),
)
def test_warming_never_overshoots_a_target_nor_touches_a_busy_node(
    nodes: int, fraction: float, demand: list[int], busy: set[int], rounds: int
) -> None:
    state = pool(nodes, fraction)
    for i, times in enumerate(demand):
        asked(state, f"m{i}", times)
    for i in busy & set(range(nodes)):
        state.nodes[i].jobs = {"busy": 8}
    wanted = hot_pool.targets(state, NOW)
    assert sum(wanted.values()) <= int(fraction * nodes)
    warmed: list[str] = []
    for _ in range(rounds):
        plan = hot_pool.warm_plan(state, NOW)
        assert len(plan) <= hot_pool.WARM_PER_PASS
        for warm in plan:  # the fetch finishes: the node holds it, and says so
            by_id = {n.info.node_id: n for n in state.nodes}
            assert not by_id[warm.node_id].jobs
            by_id[warm.node_id].info.held = {warm.item: 10 * GB}
            del state.warming[warm.node_id]
            warmed.append(warm.item)
    for item, target in wanted.items():
        assert warmed.count(item) <= target
