"""One way to reach Temporal, with the pydantic converter every model on the wire needs."""

from __future__ import annotations

from temporalio.api.enums.v1 import IndexedValueType
from temporalio.api.operatorservice.v1 import (
    AddSearchAttributesRequest,
    ListSearchAttributesRequest,
)
from temporalio.client import Client, WorkflowHandle
from temporalio.common import WorkflowIDConflictPolicy
from temporalio.contrib.pydantic import pydantic_data_converter

from infra.settings import Settings
from workflows import search_attributes
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


async def ensure_search_attributes(client: Client) -> list[str]:
    """Add the TrainingRun's search attributes the server lacks (a Temporal database made
    before they existed, or a cluster of your own); returns the names added. A run that upserts
    an attribute the server does not know would stall, so `up` and the control worker ask."""
    listed = await client.operator_service.list_search_attributes(
        ListSearchAttributesRequest(namespace=client.namespace)
    )
    missing = {
        key.name: IndexedValueType.INDEXED_VALUE_TYPE_KEYWORD
        for key in search_attributes.ALL
        if key.name not in listed.custom_attributes
    }
    if missing:
        await client.operator_service.add_search_attributes(
            AddSearchAttributesRequest(namespace=client.namespace, search_attributes=missing)
        )
    return sorted(missing)
