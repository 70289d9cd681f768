"""What a person does to a run once it exists: decide on its model, cancel it. Shared by the
CLI and the HTTP API, which differ only in how they say no."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from datetime import UTC, datetime

from temporalio.client import Client, WorkflowExecutionStatus, WorkflowUpdateFailedError
from temporalio.exceptions import WorkflowAlreadyStartedError

from infra.store.protocol import ObjectStore
from registry.decision_key import DecisionKey
from trainer.manifest import counted
from worker import runs
from worker.runs import view
from worker.specfile import SpecError, parse_spec
from workflows.contracts.decision_signature import signed
from workflows.contracts.models import MAX_REASON_CHARS, Decision, Phase, RunStatus
from workflows.contracts.spec import RunSpec


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


async def decide(client: Client, name: str, decision: Decision, key: DecisionKey) -> RunStatus:
    """Approve or reject the run's model, signed as the API's word that `decision.approver` is
    the person who asked (the run counts nothing else); the run's own gate checks who may."""
    check_reason(decision.reason)
    current = await view(client, name)
    version = current.status.model_version
    if current.status.phase != Phase.AWAITING_APPROVAL or version is None:
        raise WrongPhase(
            f"run {name} is {current.status.phase.value}: only a run AWAITING_APPROVAL can be "
            "approved or rejected"
        )
    vouched = signed(await asyncio.to_thread(key.get), name, version, decision, datetime.now(UTC))
    try:
        return await client.get_workflow_handle(name).execute_update(
            "decide", vouched, result_type=RunStatus
        )
    except WorkflowUpdateFailedError as err:
        cause = err.cause
        raise DecisionRefused(str(getattr(cause, "message", cause) or err)) from None


# A run that ended without a model to decide on: resuming it trains on from its checkpoint.
RESUMABLE = (Phase.FAILED, Phase.CANCELLED)


class NoSuchCheckpoint(RunActionError):
    """`resume --from` named a step the store keeps no checkpoint of (HTTP 422)."""


async def resume(
    client: Client,
    store: ObjectStore,
    name: str,
    from_step: int | None = None,
    nodes: int | None = None,
) -> RunStatus:
    """Run a FAILED or CANCELLED run again from its last committed checkpoint; with
    `from_step`, any run that has ended (a finished one too) from its checkpoint at that step;
    with `nodes`, on that many nodes (the checkpoint reshards to the new world size)."""
    current = await view(client, name)
    phase = current.status.phase
    if current.execution == "RUNNING" and phase == Phase.AWAITING_APPROVAL:
        raise WrongPhase(
            f"run {name} is AWAITING_APPROVAL: reject (or approve) its model first, then "
            "resume it --from a step it keeps"
        )
    if current.execution == "RUNNING" or not (
        phase in RESUMABLE or (from_step is not None and phase.final)
    ):
        raise WrongPhase(
            f"run {name} is {phase.value}: only a FAILED or CANCELLED run can be resumed from "
            "its last checkpoint, and a run that has ended (APPROVED, REJECTED or EXPIRED too) "
            "from a step it keeps (--from STEP)"
        )
    if from_step is not None:
        kept = await asyncio.to_thread(lambda: sorted(c.step for c in counted(store, name)))
        if from_step not in kept:
            steps = ", ".join(map(str, kept)) or "none"
            raise NoSuchCheckpoint(
                f"run {name} keeps no checkpoint at step {from_step}: it keeps {steps} "
                "(train.keep_checkpoints says how many are kept)"
            )
    # Applied before the new execution starts: a layout the new size breaks is refused first.
    change = functools.partial(_on_nodes, nodes) if nodes is not None else None
    with contextlib.suppress(WorkflowAlreadyStartedError):  # resumed by someone just now
        await runs.resume(client, name, from_step, change)
    return (await view(client, name)).status


def _on_nodes(nodes: int, spec: RunSpec) -> RunSpec:
    """The spec on `nodes` nodes, checked as a submitted one is (the parallel layout must
    still divide the new world size)."""
    data = spec.model_dump(mode="json")
    data["resources"] = {**data["resources"], "nodes": nodes}
    if (floor := spec.resources.min_nodes) is not None:  # an elastic run stays within --nodes
        data["resources"]["min_nodes"] = min(floor, nodes)
    try:
        return parse_spec(data, spec_dir=None)
    except SpecError as err:
        raise RunActionError(f"--nodes {nodes}: {err}") from None


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
