"""What a person does to a run once it exists: decide on its model, cancel it. Shared by the
CLI and the HTTP API, which differ only in how they say no."""

from __future__ import annotations

import asyncio
import contextlib
import time

from temporalio.client import Client, WorkflowExecutionStatus, WorkflowUpdateFailedError
from temporalio.exceptions import WorkflowAlreadyStartedError

from worker import runs
from worker.runs import view
from workflows.models import MAX_REASON_CHARS, Decision, Phase, RunStatus


class RunActionError(Exception):
    """The action cannot be done; the message says why, for a person."""


class WrongPhase(RunActionError):
    """The run is not in a phase that takes this action (HTTP 409)."""


class DecisionRefused(RunActionError):
    """The run's approval gate refused the decision (HTTP 403): not an approver, their own
    run, the eval gate."""


class StillStopping(RunActionError):
    """A cancelled run's ranks had not stopped within the wait."""


def check_reason(reason: str) -> None:
    # The reason travels in a Temporal update and becomes an MLflow tag.
    if len(reason) > MAX_REASON_CHARS:
        raise RunActionError(
            f"the note or reason is {len(reason):,} characters: keep it under {MAX_REASON_CHARS:,}"
        )


async def decide(client: Client, name: str, decision: Decision) -> RunStatus:
    """Approve or reject the run's model; the run's own gate checks who may."""
    check_reason(decision.reason)
    current = await view(client, name)
    if current.status.phase != Phase.AWAITING_APPROVAL:
        raise WrongPhase(
            f"run {name} is {current.status.phase.value}: only a run AWAITING_APPROVAL can be "
            "approved or rejected"
        )
    try:
        return await client.get_workflow_handle(name).execute_update(
            "decide", decision, result_type=RunStatus
        )
    except WorkflowUpdateFailedError as err:
        cause = err.cause
        raise DecisionRefused(str(getattr(cause, "message", cause) or err)) from None


# A run that ended without a model to decide on: resuming it trains on from its checkpoint.
RESUMABLE = (Phase.FAILED, Phase.CANCELLED)


async def resume(client: Client, name: str) -> RunStatus:
    """Run a FAILED or CANCELLED run again from its last committed checkpoint."""
    current = await view(client, name)
    if current.status.phase not in RESUMABLE or current.execution == "RUNNING":
        raise WrongPhase(
            f"run {name} is {current.status.phase.value}: only a FAILED or CANCELLED run can be "
            "resumed"
        )
    with contextlib.suppress(WorkflowAlreadyStartedError):  # resumed by someone just now
        await runs.resume(client, name)
    return (await view(client, name)).status


async def cancel(client: Client, name: str, wait_s: float) -> RunStatus:
    """Cancel the run and wait for its ranks to stop and its gang to be released."""
    current = await view(client, name)
    if current.execution != WorkflowExecutionStatus.RUNNING.name:
        raise WrongPhase(f"run {name} is not running ({current.status.phase.value})")
    handle = client.get_workflow_handle(name)
    await handle.cancel()
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        description = await handle.describe()
        if description.status != WorkflowExecutionStatus.RUNNING:
            return (await view(client, name)).status
        await asyncio.sleep(0.5)
    raise StillStopping(
        f"run {name} is still stopping after {wait_s:.0f} s; check `forgeline status {name}`"
    )
