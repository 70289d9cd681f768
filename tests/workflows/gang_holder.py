"""A minimal client of the Cluster workflow for its tests: asks for a gang, records grants."""

from __future__ import annotations

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from workflows.cluster import GANG_GRANTED_SIGNAL
    from workflows.models import Allocation, GangRequest
    from workflows.names import CLUSTER_WORKFLOW_ID


@workflow.defn(name="GangHolder")
class GangHolder:
    def __init__(self) -> None:
        self._grants: list[Allocation] = []
        self._done = False

    @workflow.run
    async def run(self, request: GangRequest) -> None:
        cluster = workflow.get_external_workflow_handle(CLUSTER_WORKFLOW_ID)
        await cluster.signal("request_gang", request)
        await workflow.wait_condition(lambda: self._done)

    @workflow.signal(name=GANG_GRANTED_SIGNAL)
    def granted(self, allocation: Allocation) -> None:
        self._grants.append(allocation)

    @workflow.signal
    def finish(self) -> None:
        self._done = True

    @workflow.query
    def grants(self) -> list[Allocation]:
        return self._grants
