"""A gang whose heartbeats stop because the control plane went away (a Temporal server
restart, a control worker's death), not its nodes: the run restarts, and the nodes stay in
service. Found by bench/soak.py: after a Temporal restart every node of the fleet was taken
for dead, and since only a restarted agent brings a dead node back, every run then waited for
ever ("more than the cluster's schedulable nodes can ever give").

The real TrainingRun and Cluster workflows on the dev server; the node agents' first
generation stops heartbeating (as a live agent's heartbeats do while Temporal is down) but
answers the liveness probe.
"""

from __future__ import annotations

import asyncio

from temporalio import activity

from tests.workflows.test_training_run_history import (
    StopsWhenTold,
    run_on_two_nodes,
    tiny_spec,
)
from workflows.contracts.cluster_models import Health
from workflows.contracts.models import NodeTrainInput, NodeTrainResult, Phase

HEARTBEAT_TIMEOUT_S = 2
LABEL = "2026-12-07-silence"


class LiveAgents(StopsWhenTold):
    """Agents that stay up: generation 1's activity beats once and then no more (its beats do
    not reach the server), later generations train to the end; the probe always answers."""

    @activity.defn(name="train_on_node")
    async def train_on_node(self, inp: NodeTrainInput) -> NodeTrainResult:
        if inp.allocation.generation == 1:
            activity.heartbeat()
            await asyncio.sleep(HEARTBEAT_TIMEOUT_S * 10)  # cancelled when the server says so
        return self.to_the_end(inp)


def test_heartbeats_lost_to_the_control_plane_leave_the_nodes_in_service(
    temporal_address: str, task_queue: str
) -> None:
    spec = tiny_spec("silence", HEARTBEAT_TIMEOUT_S)

    status, state = run_on_two_nodes(temporal_address, task_queue, spec, LiveAgents(), LABEL)
    assert status.phase == Phase.AWAITING_APPROVAL, status
    first, second = status.gang_attempts
    assert first.outcome == "failed" and second.outcome == "completed", status.gang_attempts
    # Only two nodes: the second gang ran on the same ones, which were never taken out.
    assert all(n.health == Health.HEALTHY for n in state.nodes), state.nodes
    assert state.fail_stops == 0
    assert len(status.failures) == 2
    for failure in status.failures:
        assert failure.node_id is None, failure
        assert "answers as granted" in failure.reason and "stays in service" in failure.reason
