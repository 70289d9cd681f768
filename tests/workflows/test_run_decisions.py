"""The end of a run, in seconds: the real TrainingRun and Cluster workflows on the dev server with
stand-in activities (no ranks, no MLflow) beside the control worker's real check of a decision's
signature, from the grant to a rejection, an approval, a decision forged past the API, or nobody
deciding within the approval window. The end-to-end tests drive the same through the stack."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from temporalio import activity
from temporalio.client import Client, WorkflowHandle, WorkflowUpdateFailedError
from temporalio.contrib.pydantic import pydantic_data_converter

from activities.decisions import DecisionActivities
from infra.settings import Settings
from infra.tokens import TokenStore
from registry.decision_key import DecisionKey
from tests.asgi_call import call
from tests.workflows.test_cluster_workflow import eventually
from tests.workflows.test_training_run_history import (
    STEPS,
    Control,
    _status,
    on_one_node,
    one_node_spec,
    record_histories,
)
from worker import run_actions
from worker.api import make_app
from workflows.contracts.decision_signature import signed
from workflows.contracts.models import (
    CloseTrackingInput,
    Decision,
    DecisionCheck,
    DecisionCheckInput,
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
    """The control worker's activities, with what the end of a run records and the real check
    of decisions' signatures under the decision key of `settings`' store."""

    def __init__(self, agent: Finisher, settings: Settings) -> None:
        super().__init__(agent)  # type: ignore[arg-type]
        self.recorded: list[DecisionInput] = []
        self.decisions = DecisionActivities(settings.open_store())

    @activity.defn(name="record_decision")
    async def record_decision(self, inp: DecisionInput) -> None:
        self.recorded.append(inp)

    @activity.defn(name="close_tracking_run")
    async def close_tracking_run(self, inp: CloseTrackingInput) -> None:
        return None

    @activity.defn(name="verify_decision")
    async def verify_decision(self, inp: DecisionCheckInput) -> DecisionCheck:
        # The control worker's own check, in a thread as its worker runs it (these are async).
        return await asyncio.to_thread(self.decisions.verify_decision, inp)

    def all(self) -> list:
        verify = self.verify_decision
        return [*super().all(), self.record_decision, self.close_tracking_run, verify]


@contextlib.asynccontextmanager
async def awaiting_decision(
    temporal_address: str, task_queue: str, spec: RunSpec, settings: Settings
) -> AsyncIterator[tuple[WorkflowHandle, Deciding]]:
    """The run trained (by stand-ins) and waiting for a decision; terminated afterwards."""
    agent = Finisher()
    control = Deciding(agent, settings)
    async with on_one_node(temporal_address, task_queue, spec, control, agent) as run:
        waiting = await eventually(
            lambda: _status(run), lambda s: s.phase == Phase.AWAITING_APPROVAL, timeout=60
        )
        assert waiting.phase == Phase.AWAITING_APPROVAL, waiting
        yield run, control


def settings_at(temporal_address: str, home: Path) -> Settings:
    """What the API and the control worker share: the store (its decision key) and Temporal."""
    return Settings(home=home, temporal_address=temporal_address)


async def through_the_api(settings: Settings, name: str, decision: Decision) -> RunStatus:
    """`decision` as the API takes it (worker/run_actions.decide): signed as its approver."""
    client = await Client.connect(settings.temporal_address, data_converter=pydantic_data_converter)
    key = DecisionKey(settings.open_store(), holder="the API")
    return await run_actions.decide(client, name, decision, key)


def decided(
    settings: Settings, task_queue: str, spec: RunSpec, decision: Decision | None
) -> tuple[RunStatus, list[DecisionInput]]:
    """The run's final status after `decision` (None: nobody decides) taken through the API's
    signing path, and what was recorded."""
    address = settings.temporal_address

    async def main() -> tuple[RunStatus, list[DecisionInput]]:
        async with awaiting_decision(address, task_queue, spec, settings) as (run, control):
            if decision is not None:
                await through_the_api(settings, spec.name, decision)
            final = await eventually(lambda: _status(run), lambda s: s.phase.final, timeout=30)
            await record_histories(f"{LABEL}-{spec.name}", run)
            return final, control.recorded

    return asyncio.run(main())


def as_taken(decision: Decision | None) -> Decision | None:
    """What the person decided, without the API's signature beside it."""
    return decision and decision.model_copy(update={"signed_at": None, "signature": ""})


def test_a_rejected_model_ends_the_run_with_the_decision_recorded(
    temporal_address: str, task_queue: str, tmp_path: Path
) -> None:
    no = Decision(approver="bob", approve=False, reason="samples repeat themselves")
    settings = settings_at(temporal_address, tmp_path)
    final, recorded = decided(settings, task_queue, one_node_spec("rejected"), no)
    assert final.phase == Phase.REJECTED and as_taken(final.decision) == no
    assert [(as_taken(r.decision), r.expired) for r in recorded] == [(no, False)]
    assert final.model_version is not None and recorded[0].version == final.model_version


def test_an_approved_model_is_recorded_as_approved(
    temporal_address: str, task_queue: str, tmp_path: Path
) -> None:
    yes = Decision(approver="carol", approve=True, reason="loss and samples look right")
    settings = settings_at(temporal_address, tmp_path)
    final, recorded = decided(settings, task_queue, one_node_spec("approved"), yes)
    assert final.phase == Phase.APPROVED and as_taken(final.decision) == yes
    assert [(as_taken(r.decision), r.expired) for r in recorded] == [(yes, False)]
    assert final.decision is not None and final.decision.signature  # the API's word, kept


def test_a_decision_sent_to_temporal_past_the_api_is_refused_and_one_through_it_counts(
    temporal_address: str, task_queue: str, tmp_path: Path
) -> None:
    """Anyone who reaches Temporal can send `decide` naming anyone: bare, signed with a key of
    their own, an API-signed rejection turned into an approval, an API-signed approval kept
    past its window. Each is refused, naming why, and the run still waits; then the same
    person approves through the HTTP API (the token names them) and that counts."""
    spec = one_node_spec("forged")
    settings = settings_at(temporal_address, tmp_path)
    carol = Decision(approver="carol", approve=True, reason="looks fine")

    async def main() -> tuple[list[str], RunStatus, list[DecisionInput], int]:
        async with awaiting_decision(temporal_address, task_queue, spec, settings) as (
            run,
            control,
        ):
            version = (await _status(run)).model_version
            assert version is not None
            key = DecisionKey(settings.open_store(), holder="test").get()
            now = datetime.now(UTC)
            bob_no = Decision(approver="bob", approve=False, reason="no")
            forged = [
                carol,
                signed(b"m" * 32, spec.name, version, carol, now),
                signed(key, spec.name, version, bob_no, now).model_copy(
                    update={"approver": "carol", "approve": True, "reason": "looks fine"}
                ),
                signed(key, spec.name, version, carol, now - timedelta(hours=1)),
            ]
            refusals = []
            for decision in forged:
                with pytest.raises(WorkflowUpdateFailedError) as refused:
                    await run.execute_update(TrainingRun.decide, decision)
                refusals.append(str(refused.value.cause))
            still = await _status(run)
            assert still.phase == Phase.AWAITING_APPROVAL and not control.recorded, still
            assert len(still.refused_decisions) == 4, still.refused_decisions
            answer = await approve_over_http(settings, spec.name, "carol", carol.reason)
            final = await eventually(lambda: _status(run), lambda s: s.phase.final, timeout=30)
            await record_histories(f"{LABEL}-signed-{spec.name}", run)
            return refusals, final, control.recorded, answer

    refusals, final, recorded, status = asyncio.run(main())
    assert "carries no signature of the Forgeline API" in refusals[0], refusals
    assert "does not verify under the decision key" in refusals[1], refusals
    assert "does not verify under the decision key" in refusals[2], refusals
    assert "a signature holds for 0:10:00" in refusals[3], refusals
    assert status == 200
    assert final.phase == Phase.APPROVED and as_taken(final.decision) == carol, final
    assert [(as_taken(r.decision), r.expired) for r in recorded] == [(carol, False)]
    assert all("an approval naming carol was refused" in r for r in final.refused_decisions)


async def approve_over_http(settings: Settings, name: str, person: str, note: str) -> int:
    """POST /v1/runs/NAME/approve to the real API app, with `person`'s token."""
    token, _ = TokenStore(settings.home).create(person, ["approve:default"], created_by="test")
    headers = {"authorization": f"Bearer {token}", "content-type": "application/json"}
    body = json.dumps({"note": note}).encode()
    answer = await call(make_app(settings), "POST", f"/v1/runs/{name}/approve", headers, [body])
    assert answer.status == 200, answer.body
    return answer.status


def test_the_submitter_cannot_approve_their_own_model(
    temporal_address: str, task_queue: str, tmp_path: Path
) -> None:
    spec = one_node_spec("self-approved")
    settings = settings_at(temporal_address, tmp_path)

    async def main() -> str:
        async with awaiting_decision(temporal_address, task_queue, spec, settings) as (
            run,
            control,
        ):
            mine = Decision(approver=spec.owner, approve=True)
            with pytest.raises(run_actions.DecisionRefused) as refused:
                await through_the_api(settings, spec.name, mine)
            still = await _status(run)
            assert still.phase == Phase.AWAITING_APPROVAL and not control.recorded
            assert not still.refused_decisions  # signed: refused by the gate's rules
            return str(refused.value)

    why = asyncio.run(main())
    assert f"{spec.owner} submitted run self-approved and may not approve it" in why, why


def test_nobody_deciding_within_the_window_expires_the_run(
    temporal_address: str, task_queue: str, tmp_path: Path
) -> None:
    spec = one_node_spec("unattended")
    window = spec.registry.model_copy(update={"approval_window_hours": 3 / 3600})  # 3 s
    spec = spec.model_copy(update={"registry": window})
    settings = settings_at(temporal_address, tmp_path)
    final, recorded = decided(settings, task_queue, spec, None)
    assert final.phase == Phase.EXPIRED and final.decision is None
    (expiry,) = recorded
    assert expiry.expired and expiry.decision.approver == "forgeline"
    assert not expiry.decision.approve
    assert "nobody decided within 0:00:03" in expiry.decision.reason
