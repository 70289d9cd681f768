"""One way to reach Temporal, with the pydantic converter every model on the wire needs."""

from __future__ import annotations

from temporalio.client import Client, WorkflowHandle
from temporalio.common import WorkflowIDConflictPolicy
from temporalio.contrib.pydantic import pydantic_data_converter

from infra.settings import Settings
from workflows.cluster_models import ClusterState, NodeInfo
from workflows.names import CLUSTER_WORKFLOW_ID, CONTROL_TASK_QUEUE


async def connect(settings: Settings) -> Client:
    return await Client.connect(
        settings.temporal_address,
        namespace=settings.temporal_namespace,
        data_converter=pydantic_data_converter,
    )


async def ensure_cluster(client: Client) -> WorkflowHandle:
    """Start the singleton Cluster workflow unless it runs already."""
    return await client.start_workflow(
        "Cluster",
        ClusterState(),
        id=CLUSTER_WORKFLOW_ID,
        task_queue=CONTROL_TASK_QUEUE,
        id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
    )


async def register_node(client: Client, info: NodeInfo) -> None:
    """Signal-with-start: the node registers even if it comes up before the control plane."""
    await client.start_workflow(
        "Cluster",
        ClusterState(),
        id=CLUSTER_WORKFLOW_ID,
        task_queue=CONTROL_TASK_QUEUE,
        start_signal="register_node",
        start_signal_args=[info],
    )
