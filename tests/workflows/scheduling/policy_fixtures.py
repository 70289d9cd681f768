"""Small builders for scheduling-policy tests."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from workflows.contracts.cluster_models import (
    Allocation,
    ClusterConfig,
    ClusterState,
    GangRequest,
    Node,
    NodeInfo,
    QueueConfig,
)

NOW = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)


def node(node_id: str, pod: str = "p0", gpus: int = 8, gpu_type: str = "h100", cached=()) -> Node:
    info = NodeInfo(
        node_id=node_id, pod=pod, gpus=gpus, gpu_type=gpu_type, rdzv_port=1, incarnation="i",
        cached=list(cached),
    )  # fmt: skip
    return Node(info=info)


def request(run_id: str, nodes: int = 1, gpus_per_node: int = 8, **fields) -> GangRequest:
    fields.setdefault("submitted_at", NOW)
    return GangRequest(run_id=run_id, nodes=nodes, gpus_per_node=gpus_per_node, **fields)


def running(
    state: ClusterState,
    run_id: str,
    node_ids: list[str],
    gpus_per_node: int = 8,
    team: str = "default",
    hours_left: float = 1.0,
    checkpoint_minutes_ago: float = 10.0,
    **fields,
) -> Allocation:
    """Put a gang on nodes of `state` as the Cluster workflow would have."""
    by_id = {n.info.node_id: n for n in state.nodes}
    for node_id in node_ids:
        by_id[node_id].jobs[run_id] = gpus_per_node
    allocation = Allocation(
        run_id=run_id,
        generation=state.next_generation,
        nodes=[by_id[i].info for i in node_ids],
        gpus_per_node=gpus_per_node,
        team=team,
        granted_at=NOW - timedelta(hours=1),
        expected_end=NOW + timedelta(hours=hours_left),
        last_checkpoint_at=NOW - timedelta(minutes=checkpoint_minutes_ago),
        **fields,
    )
    state.next_generation += 1
    state.allocations.append(allocation)
    return allocation


def teams(**guarantees: tuple[int, int | None]) -> ClusterConfig:
    return ClusterConfig(
        queues=[
            QueueConfig(name=name, guaranteed_gpus=g, max_gpus=m)
            for name, (g, m) in guarantees.items()
        ]
    )
