"""Placement by what must be fetched: a run that says what it reads (`GangRequest.needs`, ids
with bytes) goes where the fewest bytes must be copied, after topology; a run from before
(`cache_items` only) is placed as it was, the dataset a tie-break after packing."""

from __future__ import annotations

from tests.workflows.scheduling.policy_fixtures import request
from tests.workflows.scheduling.test_topology import capacity, fabric, racked
from workflows.contracts.cluster_models import NodeInfo
from workflows.contracts.held_items import bytes_to_fetch, checkpoint_item
from workflows.scheduling.placement import place

BASE = checkpoint_item("runs/base/checkpoints/step-500/MANIFEST.json")
GB = 10**9
NEEDS = {BASE: 100 * GB, "5eed": 2 * GB}  # a base model, and a dataset snapshot


def holding(info: NodeInfo, **held: int) -> NodeInfo:
    return info.model_copy(update={"held": {BASE if k == "base" else k: v for k, v in
                                            held.items()}})  # fmt: skip


def test_a_one_node_fine_tune_goes_to_the_node_that_holds_its_base_model() -> None:
    # n1 holds the model but is idle (8 free); n0 has 4 free, the best fit by packing alone.
    n0, n1, n2 = racked("n0"), holding(racked("n1"), base=100 * GB), racked("n2")
    free = {"n0": 4, "n1": 8, "n2": 8}
    pool = capacity([n0, n1, n2])
    pool.take("n0", 8 - free["n0"])
    assert place(request("ft", gpus_per_node=4, needs=NEEDS), pool) == ["n1"]
    # Without a byte count (a run from before) packing goes first, as it did.
    assert place(request("old", gpus_per_node=4, cache_items=["5eed"]), pool) == ["n0"]


def test_bytes_decide_between_holders_of_different_things() -> None:
    # n0 holds the dataset (2 GB), n1 the base model (100 GB): n1 fetches 2 GB, n0 100 GB.
    n0, n1 = holding(racked("n0"), **{"5eed": 2 * GB}), holding(racked("n1"), base=100 * GB)
    assert place(request("ft", needs=NEEDS), capacity([n0, n1])) == ["n1"]
    assert bytes_to_fetch(NEEDS, n1.held) == 2 * GB
    assert bytes_to_fetch({BASE: 0}, n1.held) == 0 and bytes_to_fetch({BASE: 0}, {}) == 1


def test_a_gang_goes_to_the_rack_that_holds_its_model_then_topology_still_comes_first() -> None:
    nodes = fabric({("p0", "b1", "r1"): 2, ("p0", "b1", "r2"): 3, ("p0", "b2", "r3"): 2})
    by_id = {n.node_id: n for n in nodes}
    for node_id in ("p0-b1-r2-0", "p0-b1-r2-1"):  # two of r2's three nodes hold the model
        by_id[node_id] = holding(by_id[node_id], base=100 * GB)
    nodes = list(by_id.values())
    # Two nodes: r1 and r3 are the smallest racks that hold them, but r2 has two holders.
    chosen = place(request("ft", nodes=2, needs=NEEDS), capacity(nodes))
    assert sorted(chosen or []) == ["p0-b1-r2-0", "p0-b1-r2-1"]
    # Without bytes: the smallest rack, by name (r1).
    assert sorted(place(request("old", nodes=2), capacity(nodes)) or []) == [
        "p0-b1-r1-0",
        "p0-b1-r1-1",
    ]
    # Four nodes fit no rack: block b1 (r1 + r2) is the only block that holds them, whoever
    # holds what; inside it the holders go first.
    chosen = place(request("ft", nodes=4, needs=NEEDS), capacity(nodes))
    assert chosen is not None and {"p0-b1-r2-0", "p0-b1-r2-1"} <= set(chosen)
    assert all(c.startswith("p0-b1-") for c in chosen)
    # A required rack is not traded for bytes: three nodes fit r2 only.
    chosen = place(request("ft", nodes=3, topology="rack", needs=NEEDS), capacity(nodes))
    assert sorted(chosen or []) == ["p0-b1-r2-0", "p0-b1-r2-1", "p0-b1-r2-2"]
