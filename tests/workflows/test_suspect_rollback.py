"""A corruption verdict rolls the run back past its node's first suspect: the next gang resumes
from the last checkpoint committed before the suspect step, not from the last one, and the
resume is fenced there so later lookups pass over the checkpoints in between.

The real TrainingRun and Cluster workflows on the dev server; the node agents' and the control
worker's activities answer as they would: generation 1's agent reports a suspect at step 30
(trainer.spike_watch) and a NaN verdict at step 50 naming its node, then fails; the store holds
generation 1's checkpoints at steps 20 and 40.
"""

from __future__ import annotations

import asyncio
import contextlib
from datetime import UTC, datetime

from temporalio import activity
from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.exceptions import ApplicationError

from tests.workflows.test_cluster_workflow import node
from tests.workflows.test_training_run_history import (
    STEPS,
    Control,
    awaiting_approval,
    one_node_spec,
    record_histories,
    stack_workers,
    start_cluster_and_run,
    terminated_after,
)
from workflows.cluster import ClusterWorkflow
from workflows.contracts.models import (
    CheckpointRef,
    HealthEvent,
    LatestCheckpointInput,
    NodeTrainInput,
    NodeTrainResult,
    Phase,
    RunStatus,
)
from workflows.contracts.names import HEALTH_SIGNAL
from workflows.suspect_rollback import rollback_step

LABEL = "2026-12-05-suspect-rollback"
COMMITTED = (20, 40)  # generation 1's checkpoints in the store
SUSPECT_STEP, VERDICT_STEP = 30, 50


class Agents:
    """Both nodes' agents: generation 1 reports a suspect, then a NaN verdict, and fails;
    generation 2 trains to the end from what it was told."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self.resumes: list[CheckpointRef | None] = []
        self.culprit = ""

    async def _health(self, inp: NodeTrainInput, kind: str, step: int, evidence: str) -> None:
        event = HealthEvent(generation=inp.allocation.generation, node_id=inp.node_id,
                            kind=kind, step=step, evidence=evidence,
                            action="quarantine" if kind == "corruption" else "report",
                            at=datetime.now(UTC))  # fmt: skip
        run = self.client.get_workflow_handle(activity.info().workflow_id)
        await run.signal(HEALTH_SIGNAL, event)

    @activity.defn(name="train_on_node")
    async def train_on_node(self, inp: NodeTrainInput) -> NodeTrainResult:
        self.resumes.append(inp.resume)
        if inp.allocation.generation == 1:
            self.culprit = inp.node_id
            await self._health(
                inp,
                "suspect",
                SUSPECT_STEP,
                "rank 0's own gradient norm 179.8 is 18.3 MADs from its median",
            )
            await self._health(
                inp,
                "corruption",
                VERDICT_STEP,
                "rank 0's own gradients were non-finite before the all-reduce",
            )
            await asyncio.sleep(1.0)  # the signals land before the failure does
            raise ApplicationError(
                f"ranks on node {inp.node_id}: non-finite loss or gradients at step "
                f"{VERDICT_STEP} (suspect ranks [0])",
                type="RanksFailed",
            )
        return NodeTrainResult(node_id=inp.node_id, generation=inp.allocation.generation,
                               final_step=STEPS, final_loss=1.0)  # fmt: skip

    @activity.defn(name="node_alive")
    async def node_alive(self) -> str:
        return "a"


class Store(Control):
    """The control worker's lookups against a store holding generation 1's commits."""

    @activity.defn(name="latest_checkpoint")
    async def latest_checkpoint(self, inp: LatestCheckpointInput) -> CheckpointRef | None:
        if inp.new_gang:
            self.fenced_at_most.append(inp.at_most_step)
        if inp.max_generation >= 2 and not inp.new_gang:  # after generation 2: the end
            step = STEPS
        else:
            allowed = [s for s in COMMITTED if inp.at_most_step is None or s <= inp.at_most_step]
            step = max(allowed) if inp.max_generation >= 2 else 0
        return CheckpointRef(
            manifest_key=f"runs/{inp.run_id}/checkpoints/step-{step}/gen-1/MANIFEST.json",
            step=step, generation=1, tokens_seen=step * 64,
        ) if step else None  # fmt: skip


def test_a_corruption_verdict_resumes_from_before_the_first_suspect(
    temporal_address: str, task_queue: str
) -> None:
    spec = one_node_spec("suspect-rollback")

    async def main() -> tuple[Store, Agents, RunStatus]:
        client = await Client.connect(temporal_address, data_converter=pydantic_data_converter)
        agents = Agents(client)
        control = Store(agents)  # type: ignore[arg-type]  # it reads .step alone
        acts = [agents.train_on_node, agents.node_alive]
        workers = stack_workers(client, task_queue, control, {"n0": acts, "n1": acts})
        async with contextlib.AsyncExitStack() as stack:
            cluster, handle = await start_cluster_and_run(stack, client, workers, task_queue, spec)
            async with terminated_after(handle, cluster):
                for n in ("n0", "n1"):
                    await cluster.signal(ClusterWorkflow.register_node, node(n))
                final = await awaiting_approval(handle)
                await record_histories(LABEL, handle)
                return control, agents, final

    control, agents, status = asyncio.run(main())
    assert status.phase == Phase.AWAITING_APPROVAL, status
    # The first gang looked without a bound; the second only at or before step 29, so it
    # resumed from step 20, not from step 40, which the suspect node may have spoiled.
    assert control.fenced_at_most == [None, SUSPECT_STEP - 1]
    first, second = agents.resumes
    assert first is None and second is not None and second.step == 20
    assert [(e.kind, e.step, e.node_id) for e in status.health] == [
        ("suspect", SUSPECT_STEP, agents.culprit),
        ("corruption", VERDICT_STEP, agents.culprit),
    ]
    assert [a.outcome for a in status.gang_attempts] == ["failed", "completed"]


def test_only_a_quarantined_nodes_suspects_roll_back() -> None:
    def event(kind: str, step: int, node_id: str, generation: int = 3) -> HealthEvent:
        return HealthEvent(generation=generation, node_id=node_id, kind=kind, step=step)

    corrupt = [("n1", "suspected silent corruption: …", "corruption")]
    health = [event("suspect", 80, "n1"), event("suspect", 60, "n1"), event("suspect", 10, "n0")]
    assert rollback_step(health, corrupt, 3) == 59  # the first of n1's, not n0's
    assert rollback_step(health, corrupt, 4) is None  # another generation's
    assert rollback_step(health, [("n1", "died", "fail-stop")], 3) is None  # no verdict
    assert rollback_step([event("spike", 60, "n1")], corrupt, 3) is None  # the run's, not n1's
