"""A straggler swapped out, in seconds: the real TrainingRun and Cluster workflows on the dev
server with stand-in activities. The gang's ranks stop at a checkpoint asking for a swap; the
run cordons the slow node, gives the gang back, and the next gang, without it, resumes from
that checkpoint. (tests/e2e/test_failures.py does the same with real ranks, slowly.)"""

from __future__ import annotations

import asyncio
import contextlib

from temporalio import activity
from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter

from tests.workflows.test_cluster_workflow import eventually, node
from tests.workflows.test_training_run_history import (
    STEPS,
    Control,
    _status,
    one_node_spec,
    stack_workers,
    start_cluster_and_run,
    terminated_after,
)
from workflows.cluster import ClusterWorkflow
from workflows.contracts.cluster_models import Admin
from workflows.contracts.models import (
    AttemptCause,
    AttemptOutcome,
    CheckpointRef,
    HealthEvent,
    NodeStopInput,
    NodeTrainInput,
    NodeTrainResult,
    Phase,
    RunStatus,
)

SWAPPED_AT = 40
SLOW = "n1"


class Agents:
    """Every node's agent: generation 1's ranks find n1 slow and stop at step 40 asking for a
    swap; later generations train to the end."""

    def __init__(self) -> None:
        self.step = 0  # the newest checkpoint, what the stand-in control worker finds
        self.gangs: dict[int, set[str]] = {}  # the nodes of each generation
        self.resumes: dict[int, CheckpointRef | None] = {}

    @activity.defn(name="train_on_node")
    async def train_on_node(self, inp: NodeTrainInput) -> NodeTrainResult:
        generation = inp.allocation.generation
        self.gangs[generation] = {n.node_id for n in inp.allocation.nodes}
        self.resumes[generation] = inp.resume
        if generation == 1:
            self.step = SWAPPED_AT
            why = "step time 3.1x the gang's median"
            slow = HealthEvent(generation=1, node_id=SLOW, kind="straggler", step=SWAPPED_AT,
                               evidence=why, action="swap")  # fmt: skip
            return NodeTrainResult(
                node_id=inp.node_id, generation=1, final_step=SWAPPED_AT, final_loss=2.0,
                stopped=True, stop_reason="straggler: swap", health=[slow],
            )  # fmt: skip
        self.step = STEPS
        return NodeTrainResult(node_id=inp.node_id, generation=generation, final_step=STEPS,
                               final_loss=1.0)  # fmt: skip

    @activity.defn(name="stop_training")
    async def stop_training(self, inp: NodeStopInput) -> None:
        return None


def test_a_straggler_is_swapped_out_and_the_gang_resumes_from_its_checkpoint(
    temporal_address: str, task_queue: str
) -> None:
    base = one_node_spec("swapped")
    spec = base.model_copy(update={"resources": base.resources.model_copy(update={"nodes": 2})})

    async def main() -> tuple[RunStatus, Agents, list[tuple]]:
        client = await Client.connect(temporal_address, data_converter=pydantic_data_converter)
        agents = Agents()
        control = Control(agents)  # type: ignore[arg-type]  # it reads .step alone
        acts = [agents.train_on_node, agents.stop_training]
        workers = stack_workers(client, task_queue, control, {n: acts for n in ("n0", "n1", "n2")})
        async with contextlib.AsyncExitStack() as stack:
            cluster, run = await start_cluster_and_run(stack, client, workers, task_queue, spec)
            async with terminated_after(run, cluster):
                for name in ("n0", "n1"):
                    await cluster.signal(ClusterWorkflow.register_node, node(name))
                granted = lambda s: (s.generation or 0) >= 1  # noqa: E731
                await eventually(lambda: _status(run), granted, timeout=30)
                await cluster.signal(ClusterWorkflow.register_node, node("n2"))
                final = await eventually(
                    lambda: _status(run), lambda s: s.phase == Phase.AWAITING_APPROVAL, timeout=60
                )
                state = await cluster.query(ClusterWorkflow.state)
                cordoned = [(n.info.node_id, n.admin, n.down_reason) for n in state.nodes
                            if n.admin != Admin.ACTIVE]  # fmt: skip
                return final, agents, cordoned

    final, agents, cordoned = asyncio.run(main())
    assert final.phase == Phase.AWAITING_APPROVAL, final
    assert agents.gangs[1] == {"n0", SLOW} and SLOW not in agents.gangs[2]
    resumed = agents.resumes[2]
    assert resumed is not None and resumed.step == SWAPPED_AT  # the swap lost no steps
    assert final.swaps == 1
    assert cordoned == [(SLOW, Admin.CORDONED, "straggler: step time 3.1x the gang's median")]
    attempts = [(a.generation, a.outcome, a.after) for a in final.gang_attempts]
    assert attempts == [
        (1, AttemptOutcome.SWAPPED, AttemptCause.START),
        (2, AttemptOutcome.COMPLETED, AttemptCause.SWAP),
    ]
