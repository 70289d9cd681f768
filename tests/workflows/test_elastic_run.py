"""An elastic run through the real TrainingRun and Cluster workflows on the dev server.

Two nodes, `min_nodes = 1`. Generation 1 loses n1 (its health check fails) and no node is free:
the run goes on at once on n0 alone, training the same global batch with twice the gradient
accumulation. When n2 joins, the cluster claims n0 and n2 for the run and asks it to grow
back; the one-node gang checkpoints and stops, and the run finishes on two nodes.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

from temporalio import activity
from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.exceptions import ApplicationError

from tests.workflows.test_cluster_workflow import eventually, node
from tests.workflows.test_training_run_history import (
    STEPS,
    Control,
    StopsWhenTold,
    _status,
    awaiting_approval,
    heartbeat_until,
    record_histories,
    stack_workers,
    start_cluster_and_run,
    terminated_after,
)
from worker.specfile import load_spec
from workflows.cluster import ClusterWorkflow
from workflows.contracts.models import NodeTrainInput, NodeTrainResult, RunStatus

REPO = Path(__file__).resolve().parents[2]
LABEL = "2026-12-03-elastic"
SHRUNK_STOPS_AT = 40  # the step the one-node gang checkpoints at when asked to grow back


class Agents(StopsWhenTold):
    """n0, n1 and n2's agents. Generation 1: n1's health check fails, n0's ranks lose their
    peer. The one-node generation trains until it is asked to stop; the last one finishes."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[NodeTrainInput] = []

    @activity.defn(name="train_on_node")
    async def train_on_node(self, inp: NodeTrainInput) -> NodeTrainResult:
        self.seen.append(inp)
        generation = inp.allocation.generation
        if generation == 1:
            if inp.node_id == "n1":
                raise ApplicationError("n1: health check failed: ECC errors", type="NodeUnhealthy")
            raise ApplicationError(f"ranks on {inp.node_id}: peer vanished", type="RanksFailed")
        if len(inp.allocation.nodes) == 1:
            await heartbeat_until(self.stop)
            self.step = SHRUNK_STOPS_AT
        else:
            self.step = STEPS
        return NodeTrainResult(node_id=inp.node_id, generation=generation, final_step=self.step,
                               final_loss=1.0)  # fmt: skip


def test_a_run_shrinks_after_a_failure_and_grows_back_when_a_node_joins(
    temporal_address: str, task_queue: str
) -> None:
    spec = load_spec(REPO / "examples" / "tiny.toml")
    spec = spec.model_copy(update={
        "name": "elastic",
        "resources": spec.resources.model_copy(update={"min_nodes": 1}),
    })  # fmt: skip
    agents = Agents()

    async def main() -> RunStatus:
        client = await Client.connect(temporal_address, data_converter=pydantic_data_converter)
        control = Control(agents)  # type: ignore[arg-type]  # it reads .step alone
        node_activities = [agents.train_on_node, agents.stop_training, agents.node_alive]
        workers = stack_workers(
            client, task_queue, control, dict.fromkeys(("n0", "n1", "n2"), node_activities)
        )
        async with contextlib.AsyncExitStack() as stack:
            cluster, handle = await start_cluster_and_run(stack, client, workers, task_queue, spec)
            async with terminated_after(handle, cluster):
                for n in ("n0", "n1"):
                    await cluster.signal(ClusterWorkflow.register_node, node(n))
                alone = await eventually(
                    lambda: _status(handle), lambda s: s.nodes == ["n0"], timeout=60
                )
                assert alone.shrunk_from == 2  # `forgeline status` says so
                await cluster.signal(ClusterWorkflow.register_node, node("n2"))
                final = await awaiting_approval(handle)
                await record_histories(LABEL, handle, cluster)
                return final

    status = asyncio.run(main())
    attempts = status.gang_attempts
    assert [(a.outcome, a.gpus, a.after) for a in attempts] == [
        ("failed", 2, "start"),
        ("regrown", 1, "failure"),
        ("completed", 2, "grow"),
    ], attempts
    assert status.attempts == 1  # growing back spends no restart
    assert status.shrunk_from is None
    # What the nodes were told to train: the shrunk gang the same global batch, accumulated.
    shrunk = [i for i in agents.seen if i.allocation.generation == attempts[1].generation]
    grown = [i for i in agents.seen if i.allocation.generation == attempts[2].generation]
    assert [i.node_id for i in shrunk] == ["n0"]
    assert sorted(i.node_id for i in grown) == ["n0", "n2"]
    (alone,) = shrunk
    assert (alone.spec.resources.nodes, alone.spec.train.grad_accum_steps) == (1, 2)
    assert alone.spec.train.batch_size == grown[0].spec.train.batch_size == 16
    assert all(i.spec.resources.nodes == 2 and i.spec.train.grad_accum_steps == 1 for i in grown)
    assert all(i.resume is not None and i.resume.step == SHRUNK_STOPS_AT for i in grown)
