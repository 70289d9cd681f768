"""A minimal client of the Cluster workflow for its tests: asks for a gang, records grants and
preemption notices, and (like a run) releases its gang when preempted if told to."""

from __future__ import annotations

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from workflows.contracts.cluster_models import Allocation, GangRequest, PreemptNotice, Release
    from workflows.contracts.names import CLUSTER_WORKFLOW_ID, GANG_GRANTED_SIGNAL, PREEMPT_SIGNAL


@workflow.defn(name="GangHolder")
class GangHolder:
    def __init__(self) -> None:
        self._grants: list[Allocation] = []
        self._notices: list[PreemptNotice] = []
        self._release_on_preempt = False
        self._done = False

    @workflow.run
    async def run(self, request: GangRequest) -> None:
        cluster = workflow.get_external_workflow_handle(CLUSTER_WORKFLOW_ID)
        await cluster.signal("request_gang", request)
        while not self._done:
            await workflow.wait_condition(lambda: self._done or self._should_release())
            if self._should_release():
                notice = self._notices[-1]
                self._handled = notice.generation
                await cluster.signal(
                    "release", Release(run_id=request.run_id, generation=notice.generation)
                )

    def _should_release(self) -> bool:
        return (
            self._release_on_preempt
            and bool(self._notices)
            and getattr(self, "_handled", None) != self._notices[-1].generation
        )

    @workflow.signal(name=GANG_GRANTED_SIGNAL)
    def granted(self, allocation: Allocation) -> None:
        self._grants.append(allocation)

    @workflow.signal(name=PREEMPT_SIGNAL)
    def preempted(self, notice: PreemptNotice) -> None:
        self._notices.append(notice)

    @workflow.signal
    def release_when_preempted(self) -> None:
        self._release_on_preempt = True

    @workflow.signal
    def finish(self) -> None:
        self._done = True

    @workflow.query
    def grants(self) -> list[Allocation]:
        return self._grants

    @workflow.query
    def notices(self) -> list[PreemptNotice]:
        return self._notices
