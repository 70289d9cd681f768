"""The gang-scheduling policy as pure, deterministic functions of the cluster state.

The `Cluster` workflow calls these and nothing here touches Temporal, so the same code can be
tested alone and, later, driven by a simulator.
"""

from __future__ import annotations

from collections import defaultdict

from workflows.models import GangRequest, Node, NodeInfo, NodeState


def place_gang(nodes: list[Node], request: GangRequest) -> list[NodeInfo] | None:
    """All `request.nodes` whole nodes or None: never a partial gang.

    A gang inside one pod talks over the fast fabric, so the smallest pod that can hold the whole
    gang wins (keeping big pods free for big gangs); only when no pod can, the gang spans pods,
    filling from the emptiest pod first. Ties break on ids so replays choose the same nodes.
    """
    fit = [
        n.info for n in nodes if n.state == NodeState.IDLE and n.info.gpus >= request.gpus_per_node
    ]
    if len(fit) < request.nodes:
        return None
    by_pod: dict[str, list[NodeInfo]] = defaultdict(list)
    for info in sorted(fit, key=lambda i: i.node_id):
        by_pod[info.pod].append(info)
    whole = [
        (len(members), pod) for pod, members in by_pod.items() if len(members) >= request.nodes
    ]
    if whole:
        _, pod = min(whole)
        return by_pod[pod][: request.nodes]
    chosen: list[NodeInfo] = []
    for pod in sorted(by_pod, key=lambda p: (-len(by_pod[p]), p)):
        chosen.extend(by_pod[pod][: request.nodes - len(chosen)])
    return chosen


def schedule_fifo(
    nodes: list[Node], queue: list[GangRequest]
) -> list[tuple[GangRequest, list[NodeInfo]]]:
    """Grant requests strictly in arrival order; stop at the first that does not fit.

    Stopping at the head keeps a large gang from starving behind a stream of small ones.
    """
    free = [n.model_copy() for n in nodes]
    grants: list[tuple[GangRequest, list[NodeInfo]]] = []
    for request in queue:
        placed = place_gang(free, request)
        if placed is None:
            break
        taken = {info.node_id for info in placed}
        for node in free:
            if node.info.node_id in taken:
                node.state = NodeState.ALLOCATED
        grants.append((request, placed))
    return grants
