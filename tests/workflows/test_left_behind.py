"""A gang whose ranks ended at the run's end on one node while another node's rank never
exits (stuck in its teardown: a plain torchrun script's rank, its process group freed with its
peer gone, sat in a futex for 20 minutes). The run waited in TRAINING for ever; now the
stuck node's ranks are stopped after recovery.exit_grace_s and the run goes on to evaluation,
with the node reported, not blamed.

The real TrainingRun and Cluster workflows on the dev server; the node agents' activities
stand in for the ranks (n1's never returns until it is cancelled, as its agent does when the
workflow stops the ranks).
"""

from __future__ import annotations

import asyncio

from temporalio import activity

from tests.workflows.test_training_run_history import (
    STEPS,
    run_on_two_nodes,
    tiny_spec,
)
from workflows.contracts.cluster_models import Health
from workflows.contracts.models import NodeTrainInput, NodeTrainResult, Phase

EXIT_GRACE_S = 3
LABEL = "2026-12-07-left-behind"


class OneStuckAgent:
    """n0's ranks train to the end and exit; n1's trained to the end too but one of them never
    exits: its activity keeps beating until the workflow cancels it."""

    def __init__(self) -> None:
        self.step = 0  # what Control's latest_checkpoint reports
        self.cancelled: list[str] = []

    @activity.defn(name="train_on_node")
    async def train_on_node(self, inp: NodeTrainInput) -> NodeTrainResult:
        self.step = STEPS
        if inp.node_id == "n1":
            try:
                while True:
                    activity.heartbeat()
                    await asyncio.sleep(0.5)
            except asyncio.CancelledError:
                self.cancelled.append(inp.node_id)
                raise
        return NodeTrainResult(node_id=inp.node_id, generation=inp.allocation.generation,
                               final_step=STEPS, final_loss=1.0)  # fmt: skip

    @activity.defn(name="node_alive")
    async def node_alive(self) -> str:
        return "a"


def test_a_rank_that_never_exits_after_the_end_is_stopped_and_the_run_goes_on(
    temporal_address: str, task_queue: str
) -> None:
    spec = tiny_spec("left-behind", 5)
    recovery = spec.recovery.model_copy(update={"exit_grace_s": EXIT_GRACE_S})
    spec = spec.model_copy(update={"recovery": recovery})

    agents = OneStuckAgent()
    status, state = run_on_two_nodes(temporal_address, task_queue, spec, agents, LABEL)
    cancelled = agents.cancelled
    assert status.phase == Phase.AWAITING_APPROVAL, status
    # One attempt, completed: no restart spent, no failure, no node blamed or drained.
    assert [a.outcome for a in status.gang_attempts] == ["completed"], status.gang_attempts
    assert status.failures == []
    assert cancelled == ["n1"]
    assert all(n.health == Health.HEALTHY for n in state.nodes), state.nodes
    (reported,) = [e for e in status.health if e.kind == "left-behind"]
    assert reported.node_id == "n1" and f"not exited {EXIT_GRACE_S} s" in reported.evidence
