"""The end of a run, in seconds: the real TrainingRun and Cluster workflows on the dev server with
stand-in activities (no ranks, no MLflow), from the grant to a rejection, an approval, or nobody
deciding within the approval window. The end-to-end tests drive the same through the stack."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
from temporalio import activity
from temporalio.client import WorkflowHandle, WorkflowUpdateFailedError

from tests.workflows.test_cluster_workflow import eventually
from tests.workflows.test_training_run_history import (
    STEPS,
    Control,
    _status,
    on_one_node,
    one_node_spec,
    record_histories,
)
from workflows.contracts.models import (
    CloseTrackingInput,
    Decision,
    DecisionInput,
    NodeStopInput,
    NodeTrainInput,
    NodeTrainResult,
    Phase,
    RunStatus,
)
from workflows.contracts.spec import RunSpec
from workflows.training_run import TrainingRun

# FORGELINE_RECORD_HISTORIES=tests/workflows/histories records the runs' histories: the first
# with the fence as an activity of its own (`fence-apart`), replayed ever since.
LABEL = "2026-12-06"


class Finisher:
    """A node agent whose ranks train to the last step at once."""

    def __init__(self) -> None:
        self.step = 0  # the newest checkpoint (what the stand-in control worker finds)

    @activity.defn(name="train_on_node")
    async def train_on_node(self, inp: NodeTrainInput) -> NodeTrainResult:
        self.step = STEPS
        return NodeTrainResult(node_id=inp.node_id, generation=inp.allocation.generation,
                               final_step=STEPS, final_loss=1.0)  # fmt: skip

    @activity.defn(name="stop_training")
    async def stop_training(self, inp: NodeStopInput) -> None:
        return None


class Deciding(Control):
    """The control worker's activities, with what the end of a run records."""

    def __init__(self, agent: Finisher) -> None:
        super().__init__(agent)  # type: ignore[arg-type]
        self.recorded: list[DecisionInput] = []

    @activity.defn(name="record_decision")
    async def record_decision(self, inp: DecisionInput) -> None:
        self.recorded.append(inp)

    @activity.defn(name="close_tracking_run")
    async def close_tracking_run(self, inp: CloseTrackingInput) -> None:
        return None

    def all(self) -> list:
        return [*super().all(), self.record_decision, self.close_tracking_run]


@contextlib.asynccontextmanager
async def awaiting_decision(
    temporal_address: str, task_queue: str, spec: RunSpec
) -> AsyncIterator[tuple[WorkflowHandle, Deciding]]:
    """The run trained (by stand-ins) and waiting for a decision; terminated afterwards."""
    agent = Finisher()
    control = Deciding(agent)
    async with on_one_node(temporal_address, task_queue, spec, control, agent) as run:
        waiting = await eventually(
            lambda: _status(run), lambda s: s.phase == Phase.AWAITING_APPROVAL, timeout=60
        )
        assert waiting.phase == Phase.AWAITING_APPROVAL, waiting
        yield run, control


def decided(
    temporal_address: str, task_queue: str, spec: RunSpec, decision: Decision | None
) -> tuple[RunStatus, list[DecisionInput]]:
    """The run's final status after `decision` (None: nobody decides), and what was recorded."""

    async def main() -> tuple[RunStatus, list[DecisionInput]]:
        async with awaiting_decision(temporal_address, task_queue, spec) as (run, control):
            if decision is not None:
                await run.execute_update(TrainingRun.decide, decision)
            final = await eventually(lambda: _status(run), lambda s: s.phase.final, timeout=30)
            await record_histories(f"{LABEL}-{spec.name}", run)
            return final, control.recorded

    return asyncio.run(main())


def test_a_rejected_model_ends_the_run_with_the_decision_recorded(
    temporal_address: str, task_queue: str
) -> None:
    no = Decision(approver="bob", approve=False, reason="samples repeat themselves")
    final, recorded = decided(temporal_address, task_queue, one_node_spec("rejected"), no)
    assert final.phase == Phase.REJECTED and final.decision == no
    assert [(r.decision, r.expired) for r in recorded] == [(no, False)]
    assert final.model_version is not None and recorded[0].version == final.model_version


def test_an_approved_model_is_recorded_as_approved(temporal_address: str, task_queue: str) -> None:
    yes = Decision(approver="carol", approve=True, reason="loss and samples look right")
    final, recorded = decided(temporal_address, task_queue, one_node_spec("approved"), yes)
    assert final.phase == Phase.APPROVED and final.decision == yes
    assert [(r.decision, r.expired) for r in recorded] == [(yes, False)]


def test_the_submitter_cannot_approve_their_own_model(
    temporal_address: str, task_queue: str
) -> None:
    spec = one_node_spec("self-approved")

    async def main() -> str:
        async with awaiting_decision(temporal_address, task_queue, spec) as (run, control):
            mine = Decision(approver=spec.owner, approve=True)
            with pytest.raises(WorkflowUpdateFailedError) as refused:
                await run.execute_update(TrainingRun.decide, mine)
            still = await _status(run)
            assert still.phase == Phase.AWAITING_APPROVAL and not control.recorded
            return str(refused.value.cause)

    why = asyncio.run(main())
    assert f"{spec.owner} submitted run self-approved and may not approve it" in why, why


def test_nobody_deciding_within_the_window_expires_the_run(
    temporal_address: str, task_queue: str
) -> None:
    spec = one_node_spec("unattended")
    window = spec.registry.model_copy(update={"approval_window_hours": 3 / 3600})  # 3 s
    spec = spec.model_copy(update={"registry": window})
    final, recorded = decided(temporal_address, task_queue, spec, None)
    assert final.phase == Phase.EXPIRED and final.decision is None
    (expiry,) = recorded
    assert expiry.expired and expiry.decision.approver == "forgeline"
    assert not expiry.decision.approve
    assert "nobody decided within 0:00:03" in expiry.decision.reason
