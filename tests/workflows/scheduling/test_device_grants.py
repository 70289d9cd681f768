"""A grant names which GPUs of a node each job holds: two jobs packed on one node never see
the same device, and a device freed by one job goes to the next."""

from __future__ import annotations

from workflows.contracts.cluster_models import ClusterConfig, ClusterState
from workflows.scheduling.cluster_ops import allocation_of, free, run_pass
from workflows.scheduling.policy_switches import TODAY

from .policy_fixtures import NOW, node, request, running


def _state(*nodes) -> ClusterState:
    return ClusterState(config=ClusterConfig(spare_nodes=0), nodes=list(nodes))


def _grant(state: ClusterState, *requests) -> None:
    state.queue.extend(requests)
    run_pass(state, NOW, TODAY)


def test_two_four_gpu_jobs_on_one_eight_gpu_node_hold_different_devices() -> None:
    state = _state(node("n0"))
    _grant(state, request("a", gpus_per_node=4), request("b", gpus_per_node=4))
    a, b = allocation_of(state, "a"), allocation_of(state, "b")
    assert a is not None and b is not None
    assert a.nodes[0].node_id == b.nodes[0].node_id == "n0"  # packed on the one node
    assert sorted(a.devices_on("n0") + b.devices_on("n0")) == list(range(8))
    assert len(a.devices_on("n0")) == len(b.devices_on("n0")) == 4


def test_a_device_freed_by_one_job_goes_to_the_next() -> None:
    state = _state(node("n0"))
    _grant(state, request("a", gpus_per_node=2), request("b", gpus_per_node=4))
    a = allocation_of(state, "a")
    assert a is not None
    freed = a.devices_on("n0")
    free(state, a, NOW)
    _grant(state, request("c", gpus_per_node=2))
    c, b = allocation_of(state, "c"), allocation_of(state, "b")
    assert c is not None and b is not None
    assert c.devices_on("n0") == freed
    assert not set(c.devices_on("n0")) & set(b.devices_on("n0"))


def test_a_job_beside_a_grant_from_before_devices_were_named_takes_the_others() -> None:
    # A grant of an earlier Cluster workflow lists no devices: its ranks used cuda:0..3.
    state = _state(node("n0"))
    old = running(state, "old", ["n0"], gpus_per_node=4)
    assert old.devices == {} and old.devices_on("n0") == [0, 1, 2, 3]
    _grant(state, request("new", gpus_per_node=4))
    new = allocation_of(state, "new")
    assert new is not None and new.devices_on("n0") == [4, 5, 6, 7]


def test_a_gang_of_whole_nodes_holds_every_device_and_lists_none() -> None:
    state = _state(node("n0"), node("n1"))
    _grant(state, request("gang", nodes=2, gpus_per_node=8))
    gang = allocation_of(state, "gang")
    assert gang is not None
    assert gang.devices == {}  # nothing travels per node for a node held whole
    assert gang.devices_on("n0") == gang.devices_on("n1") == list(range(8))
    assert gang.devices_on("elsewhere") == []
