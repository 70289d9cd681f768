from workflows.models import GangRequest, Node, NodeInfo, NodeState
from workflows.scheduling import place_gang, schedule_fifo


def node(node_id: str, pod: str = "p0", gpus: int = 1, state: NodeState = NodeState.IDLE) -> Node:
    info = NodeInfo(node_id=node_id, pod=pod, gpus=gpus, rdzv_port=1, incarnation="x")
    return Node(info=info, state=state)


def ids(placed) -> list[str]:
    return [i.node_id for i in placed]


def test_all_or_nothing() -> None:
    nodes = [node("a"), node("b"), node("c", state=NodeState.DOWN)]
    assert place_gang(nodes, GangRequest(run_id="r", nodes=3, gpus_per_node=1)) is None
    assert ids(place_gang(nodes, GangRequest(run_id="r", nodes=2, gpus_per_node=1))) == ["a", "b"]


def test_nodes_without_enough_gpus_do_not_count() -> None:
    nodes = [node("a", gpus=1), node("b", gpus=2), node("c", gpus=2)]
    assert ids(place_gang(nodes, GangRequest(run_id="r", nodes=2, gpus_per_node=2))) == ["b", "c"]


def test_gang_stays_in_the_smallest_pod_that_holds_it() -> None:
    nodes = [node(f"big{i}", "big") for i in range(4)] + [
        node(f"small{i}", "small") for i in range(2)
    ]
    placed = place_gang(nodes, GangRequest(run_id="r", nodes=2, gpus_per_node=1))
    assert {i.pod for i in placed} == {"small"}


def test_gang_spans_pods_only_when_no_pod_can_hold_it() -> None:
    nodes = [node("a0", "a"), node("a1", "a"), node("b0", "b")]
    placed = place_gang(nodes, GangRequest(run_id="r", nodes=3, gpus_per_node=1))
    assert sorted(ids(placed)) == ["a0", "a1", "b0"]


def test_fifo_never_lets_a_later_request_jump_the_head() -> None:
    nodes = [node("a"), node("b")]
    queue = [
        GangRequest(run_id="first", nodes=1, gpus_per_node=1),
        GangRequest(run_id="big", nodes=3, gpus_per_node=1),
        GangRequest(run_id="small", nodes=1, gpus_per_node=1),
    ]
    grants = schedule_fifo(nodes, queue)
    assert [(r.run_id, ids(p)) for r, p in grants] == [("first", ["a"])]
    # The input is not modified: the workflow applies grants itself.
    assert all(n.state == NodeState.IDLE for n in nodes)


def test_fifo_grants_several_disjoint_gangs() -> None:
    nodes = [node(n) for n in "abcd"]
    queue = [GangRequest(run_id=r, nodes=2, gpus_per_node=1) for r in ("r1", "r2", "r3")]
    grants = schedule_fifo(nodes, queue)
    assert [(r.run_id, ids(p)) for r, p in grants] == [("r1", ["a", "b"]), ("r2", ["c", "d"])]
