"""What operators change in the Cluster workflow: a node's service state, the cluster's
configuration. Shared by the CLI and the HTTP API."""

from __future__ import annotations

from temporalio.client import Client, WorkflowUpdateFailedError

from workflows.contracts.cluster_models import ClusterConfig, Node, NodeAdmin
from workflows.contracts.names import CLUSTER_WORKFLOW_ID


class ClusterRefused(Exception):
    """The Cluster workflow refused the change (an unknown node); the message says why."""


async def set_node_admin(client: Client, change: NodeAdmin) -> Node:
    handle = client.get_workflow_handle(CLUSTER_WORKFLOW_ID)
    try:
        return await handle.execute_update("set_node_admin", change, result_type=Node)
    except WorkflowUpdateFailedError as err:
        raise ClusterRefused(str(getattr(err.cause, "message", err.cause) or err)) from None


async def apply_config(client: Client, config: ClusterConfig) -> ClusterConfig:
    handle = client.get_workflow_handle(CLUSTER_WORKFLOW_ID)
    return await handle.execute_update("apply_config", config, result_type=ClusterConfig)
