"""The `Cluster` entity workflow: one per cluster, it owns every node and every allocation.

Node agents register by signal; training runs ask for gangs, release them and report failed
nodes by signal; grants go back to the run as a signal. Everything is keyed by generation: a
release or report that names an older generation than the allocation's is stale and ignored.
"""

from __future__ import annotations

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from workflows.models import (
        Allocation,
        ClusterState,
        GangRequest,
        Node,
        NodeFailure,
        NodeInfo,
        NodeState,
        Release,
    )
    from workflows.scheduling import schedule_fifo

GANG_GRANTED_SIGNAL = "gang_granted"


@workflow.defn(name="Cluster")
class ClusterWorkflow:
    @workflow.init
    def __init__(self, state: ClusterState | None = None) -> None:
        self._state = state or ClusterState()
        self._outbox: list[Allocation] = []
        self._dirty = True

    @workflow.run
    async def run(self, state: ClusterState | None = None) -> None:
        while True:
            await workflow.wait_condition(
                lambda: self._dirty or bool(self._outbox) or self._should_continue_as_new()
            )
            if self._dirty:
                self._dirty = False
                self._schedule()
            while self._outbox:
                await self._send_grant(self._outbox.pop(0))
            if self._should_continue_as_new():
                await workflow.wait_condition(workflow.all_handlers_finished)
                workflow.continue_as_new(self._state)

    def _should_continue_as_new(self) -> bool:
        return workflow.info().is_continue_as_new_suggested()

    # --- signals ---------------------------------------------------------------------------

    @workflow.signal
    def register_node(self, info: NodeInfo) -> None:
        node = self._node(info.node_id)
        if node is None:
            self._state.nodes.append(Node(info=info))
        else:
            restarted = node.info.incarnation != info.incarnation
            node.info = info
            # A restarted agent that was down is healthy again; an allocated one stays
            # allocated until its run releases it, so it is never booked twice.
            if restarted and node.state == NodeState.DOWN:
                node.state = NodeState.IDLE
                node.down_reason = None
        self._dirty = True

    @workflow.signal
    def node_stopped(self, info: NodeInfo) -> None:
        """The agent is shutting down: its node takes no new work until it registers again."""
        node = self._node(info.node_id)
        if node is not None and node.info.incarnation == info.incarnation:
            node.state = NodeState.DOWN
            node.down_reason = "agent stopped"
            self._dirty = True

    @workflow.signal
    def request_gang(self, request: GangRequest) -> None:
        held = self._allocation(request.run_id)
        if held is not None:
            # The run asked again (e.g. its workflow task was retried): resend what it holds.
            self._outbox.append(held)
            return
        if all(r.run_id != request.run_id for r in self._state.queue):
            self._state.queue.append(request)
            self._dirty = True

    @workflow.signal
    def release(self, release: Release) -> None:
        self._state.queue = [r for r in self._state.queue if r.run_id != release.run_id]
        held = self._allocation(release.run_id)
        if held is None or held.generation != release.generation:
            return
        self._state.allocations.remove(held)
        for node in self._state.nodes:
            if node.run_id == release.run_id and node.generation == release.generation:
                if node.state == NodeState.ALLOCATED:
                    node.state = NodeState.IDLE
                node.run_id = None
                node.generation = None
        self._dirty = True

    @workflow.signal
    def report_failure(self, failure: NodeFailure) -> None:
        node = self._node(failure.node_id)
        if node is None or node.generation != failure.generation:
            return
        node.state = NodeState.DOWN
        node.down_reason = failure.reason
        self._dirty = True

    @workflow.query
    def state(self) -> ClusterState:
        return self._state

    # --- internals -------------------------------------------------------------------------

    def _node(self, node_id: str) -> Node | None:
        return next((n for n in self._state.nodes if n.info.node_id == node_id), None)

    def _allocation(self, run_id: str) -> Allocation | None:
        return next((a for a in self._state.allocations if a.run_id == run_id), None)

    def _schedule(self) -> None:
        for request, placed in schedule_fifo(self._state.nodes, self._state.queue):
            generation = self._state.next_generation
            self._state.next_generation += 1
            allocation = Allocation(run_id=request.run_id, generation=generation, nodes=placed)
            taken = {info.node_id for info in placed}
            for node in self._state.nodes:
                if node.info.node_id in taken:
                    node.state = NodeState.ALLOCATED
                    node.run_id = request.run_id
                    node.generation = generation
            self._state.queue.remove(request)
            self._state.allocations.append(allocation)
            self._outbox.append(allocation)

    async def _send_grant(self, allocation: Allocation) -> None:
        try:
            await workflow.get_external_workflow_handle(allocation.run_id).signal(
                GANG_GRANTED_SIGNAL, allocation
            )
        except Exception as err:  # the run is gone (terminated, deleted): take the nodes back
            workflow.logger.warning("grant to %s failed (%s); releasing", allocation.run_id, err)
            self.release(Release(run_id=allocation.run_id, generation=allocation.generation))
