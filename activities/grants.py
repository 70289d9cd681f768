"""The control worker's check of a gang grant a run received (workflows.training_run): a
Temporal signal carries no sender, so a run asks the Cluster workflow whether it holds that
allocation before any rank starts on the nodes it names."""

from __future__ import annotations

from datetime import timedelta

from temporalio import activity
from temporalio.client import Client

from workflows.contracts.cluster_models import ClusterState, GrantCheck
from workflows.contracts.names import CLUSTER_WORKFLOW_ID


class GrantActivities:
    def __init__(self, client: Client) -> None:
        self.client = client

    @activity.defn(name="confirm_grant")
    async def confirm_grant(self, check: GrantCheck) -> bool:
        """True when the Cluster workflow holds exactly this allocation for the run: its
        generation, its nodes (and their agents' incarnations), their hosts and rendezvous
        ports."""
        state = await self.client.get_workflow_handle(CLUSTER_WORKFLOW_ID).query(
            "state", result_type=ClusterState, rpc_timeout=timedelta(seconds=20)
        )
        held = next((a for a in state.allocations if a.run_id == check.run_id), None)
        return held is not None and check.holds(held)
