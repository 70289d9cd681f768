"""Placement inside the fabric's levels (pod → block → rack → node): the smallest unit that holds
a gang at the lowest level it can, else the fewest units level by level; a level a spec requires
is all or nothing, or waits its `topology_wait_s` and then takes the fewest units."""

from __future__ import annotations

from collections import Counter
from datetime import timedelta

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from tests.workflows.scheduling.policy_fixtures import NOW, request
from workflows.contracts.cluster_models import ClusterConfig, ClusterState, Node, NodeInfo
from workflows.contracts.spec import ResourcesSpec
from workflows.scheduling.placement import Capacity, place
from workflows.scheduling.scheduler import schedule
from workflows.scheduling.topology import landed, path

LEVELS = ("block", "rack")


def racked(node_id: str, pod: str = "p0", block: str = "b1", rack: str = "r1") -> NodeInfo:
    return NodeInfo(
        node_id=node_id, pod=pod, gpus=8, gpu_type="h100", rdzv_port=1, incarnation="i",
        topology={"block": block, "rack": rack},
    )  # fmt: skip


def fabric(layout: dict[tuple[str, str, str], int]) -> list[NodeInfo]:
    """Idle nodes: (pod, block, rack) -> how many."""
    return [
        racked(f"{pod}-{block}-{rack}-{i}", pod, block, rack)
        for (pod, block, rack), count in layout.items()
        for i in range(count)
    ]


def capacity(nodes: list[NodeInfo], levels: tuple[str, ...] = LEVELS) -> Capacity:
    return Capacity(((n, n.gpus) for n in nodes), levels)


def units(chosen: list[str], nodes: list[NodeInfo], depth: int) -> set[tuple[str, ...]]:
    by_id = {n.node_id: n for n in nodes}
    return {path(by_id[i], LEVELS)[: depth + 1] for i in chosen}


# Pod p0: block b1 with racks of 3 and 2 nodes, block b2 with one rack of 4. Pod p1: 6 nodes in
# three racks of 2.
LAYOUT = {
    ("p0", "b1", "r1"): 3,
    ("p0", "b1", "r2"): 2,
    ("p0", "b2", "r3"): 4,
    ("p1", "b3", "r4"): 2,
    ("p1", "b3", "r5"): 2,
    ("p1", "b4", "r6"): 2,
}


def test_a_gang_that_fits_a_rack_takes_the_smallest_rack_that_holds_it() -> None:
    nodes = fabric(LAYOUT)
    chosen = place(request("g", nodes=3), capacity(nodes))
    assert chosen is not None and units(chosen, nodes, 2) == {("p0", "b1", "r1")}
    chosen = place(request("g", nodes=4), capacity(nodes))
    assert chosen is not None and units(chosen, nodes, 2) == {("p0", "b2", "r3")}


def test_else_the_smallest_block_then_the_fewest_racks_in_it() -> None:
    nodes = fabric(LAYOUT)
    chosen = place(request("g", nodes=5), capacity(nodes))  # no rack has 5: block b1 has 5
    assert chosen is not None and units(chosen, nodes, 1) == {("p0", "b1")}
    chosen = place(request("g", nodes=3), capacity(nodes[3:]))  # r1 gone: no rack of 3 left
    # With r1 gone the racks hold 2, 4, 2, 2, 2 nodes: only r3 holds 3.
    assert chosen is not None and units(chosen, nodes, 2) == {("p0", "b2", "r3")}
    chosen = place(request("g", nodes=6), capacity(nodes))  # pod p1: three racks, no block of 6
    assert chosen is not None and units(chosen, nodes, 0) == {("p1",)}
    assert len(units(chosen, nodes, 1)) == 2 and len(units(chosen, nodes, 2)) == 3


def test_a_gang_no_pod_holds_spans_the_fewest_pods_and_racks() -> None:
    nodes = fabric(LAYOUT)
    chosen = place(request("g", nodes=11), capacity(nodes))
    assert chosen is not None and len(set(chosen)) == 11
    assert len(units(chosen, nodes, 0)) == 2
    # p0 (9 nodes) whole, then 2 of p1 from one rack.
    assert Counter(p[:1] for p in units(chosen, nodes, 2)) == {("p0",): 3, ("p1",): 1}


def test_a_required_rack_is_all_or_nothing() -> None:
    nodes = fabric(LAYOUT)
    assert place(request("g", nodes=5, topology="rack"), capacity(nodes)) is None
    chosen = place(request("g", nodes=4, topology="rack"), capacity(nodes))
    assert chosen is not None and units(chosen, nodes, 2) == {("p0", "b2", "r3")}
    # A required block: 5 fits b1 (two racks), 6 fits no block.
    chosen = place(request("g", nodes=5, topology="block"), capacity(nodes))
    assert chosen is not None and units(chosen, nodes, 1) == {("p0", "b1")}
    assert place(request("g", nodes=6, topology="block"), capacity(nodes)) is None
    # "pod" is the old allow_multi_pod = false.
    assert place(request("g", nodes=10, topology="pod"), capacity(nodes)) is None


def test_a_node_without_a_label_is_a_rack_of_its_own() -> None:
    nodes = [racked("a"), racked("b"), racked("c", rack="r2")]
    nodes[1] = nodes[1].model_copy(update={"topology": {"block": "b1"}})  # no rack label
    assert place(request("g", nodes=2, topology="rack"), capacity(nodes)) is None
    assert place(request("g", nodes=2, topology="block"), capacity(nodes)) is not None


def _state(nodes: list[NodeInfo], *requests) -> ClusterState:
    return ClusterState(
        config=ClusterConfig(levels=list(LEVELS)),
        nodes=[Node(info=n) for n in nodes],
        queue=list(requests),
    )


def test_a_required_rack_waits_saying_so_and_a_wait_ends_in_the_fewest_racks() -> None:
    nodes = fabric({("p0", "b1", "r1"): 2, ("p0", "b1", "r2"): 2})
    required = request("g", nodes=3, topology="rack")
    decisions = schedule(_state(nodes, required), NOW)
    assert decisions.grants == []
    (waiting,) = decisions.waiting
    assert "in one rack" in waiting.reason and "can ever give" in waiting.reason

    patient = request("g", nodes=3, topology="rack", topology_wait_s=600)
    early = schedule(_state(nodes, patient), NOW + timedelta(seconds=599))
    assert early.grants == [] and "in one rack" in early.waiting[0].reason
    late = schedule(_state(nodes, patient), NOW + timedelta(seconds=600))
    ((granted, chosen),) = late.grants
    assert len(units(chosen, nodes, 2)) == 2 and granted.topology is None

    preferred = request("g", nodes=3, topology="rack", topology_wait_s=0)
    ((_, chosen),) = schedule(_state(nodes, preferred), NOW).grants
    assert len(units(chosen, nodes, 2)) == 2


def test_a_level_the_cluster_does_not_declare_is_named_in_the_wait() -> None:
    decisions = schedule(_state(fabric(LAYOUT), request("g", nodes=2, topology="row")), NOW)
    assert decisions.grants == []
    assert "'row'" in decisions.waiting[0].reason
    assert "pod, block, rack" in decisions.waiting[0].reason


def test_where_a_gang_landed_in_words() -> None:
    nodes = fabric(LAYOUT)
    by_id = {n.node_id: n for n in nodes}

    def words(chosen: list[str] | None) -> str:
        assert chosen is not None
        return landed([by_id[i] for i in chosen], LEVELS)

    assert words(place(request("g", nodes=4), capacity(nodes))) == "rack p0/b2/r3"
    assert words(place(request("g", nodes=5), capacity(nodes))) == "block p0/b1: 2 racks"
    assert words(place(request("g", nodes=6), capacity(nodes))) == "pod p1: 2 blocks, 3 racks"
    assert words(place(request("g", nodes=11), capacity(nodes))) == "2 pods, 3 blocks, 4 racks"
    assert landed([racked("x")], ()) == "pod p0"


def test_cluster_levels_and_spec_topology_are_checked() -> None:
    with pytest.raises(ValidationError, match="always there"):
        ClusterConfig(levels=["pod", "rack"])
    with pytest.raises(ValidationError, match="declared twice"):
        ClusterConfig(levels=["rack", "rack"])
    with pytest.raises(ValidationError, match=r"resources\.nodes = 1"):
        ResourcesSpec(nodes=2, topology="node")
    with pytest.raises(ValidationError, match=r"without resources\.topology"):
        ResourcesSpec(nodes=2, topology_wait_min=5)


# --- properties: no gang spans more units than it needs ---------------------------------------


@st.composite
def fabrics(draw: st.DrawFn) -> list[NodeInfo]:
    layout = {}
    for p in range(draw(st.integers(1, 3))):
        for b in range(draw(st.integers(1, 3))):
            for r in range(draw(st.integers(1, 3))):
                layout[(f"p{p}", f"b{p}{b}", f"r{p}{b}{r}")] = draw(st.integers(0, 4))
    return fabric(layout)


def _fewest_needed(sizes: list[int], count: int) -> int:
    """The least number of units (of these sizes) that hold `count` nodes."""
    total = 0
    for used, size in enumerate(sorted(sizes, reverse=True), start=1):
        total += size
        if total >= count:
            return used
    raise AssertionError("does not fit")


def _unit_sizes(nodes: list[NodeInfo], depth: int, inside: tuple[str, ...] = ()) -> Counter:
    return Counter(
        path(n, LEVELS)[: depth + 1] for n in nodes if path(n, LEVELS)[: len(inside)] == inside
    )


@settings(max_examples=200, deadline=None)
@given(
    nodes=fabrics(),
    count=st.integers(2, 30),
    required=st.sampled_from([None, "pod", "block", "rack"]),
)
@example(nodes=fabric(LAYOUT), count=11, required=None)
def test_no_gang_spans_more_units_than_it_needs(
    nodes: list[NodeInfo], count: int, required: str | None
) -> None:
    gang = request("g", nodes=count, topology=required)
    chosen = place(gang, capacity(nodes))
    need_depth = None if required is None else ["pod", "block", "rack"].index(required)
    # The lowest level at which one unit holds the gang (None: no pod holds it).
    lowest = next(
        (d for d in (2, 1, 0) if max(_unit_sizes(nodes, d).values(), default=0) >= count), None
    )
    if chosen is None:
        assert count > len(nodes) or (
            need_depth is not None and (lowest is None or lowest < need_depth)
        )
        return
    assert len(chosen) == len(set(chosen)) == count
    if lowest is not None:
        assert len(units(chosen, nodes, lowest)) == 1
        assert need_depth is None or lowest >= need_depth
    # Level by level, inside every unit it uses, the fewest units one level down.
    for depth in (0, 1, 2):
        taken = Counter(path(n, LEVELS)[:depth] for n in nodes if n.node_id in chosen)
        for parent, many in taken.items():
            used = {p for p in units(chosen, nodes, depth) if p[:depth] == parent}
            sizes = list(_unit_sizes(nodes, depth, parent).values())
            assert len(used) == _fewest_needed(sizes, many), (parent, used, sizes)
