"""The end of a TrainingRun: the MLflow run opened at the start, evaluation, registration, and
the wait for an authorised decision. Deterministic workflow code, run by the TrainingRun
workflow through a `RunEnd` it makes with what these steps read and write: the run's input,
spec and status, its way of calling a control-worker activity, of changing phase, and of
reading the decision its update handler received."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError

with workflow.unsafe.imports_passed_through():
    from workflows.approval import gate_tags, with_spec
    from workflows.contracts.models import (
        ApprovalPolicy,
        ApprovalPolicyInput,
        CheckpointRef,
        CloseTrackingInput,
        DatasetRef,
        Decision,
        DecisionCheck,
        DecisionCheckInput,
        DecisionInput,
        EvalResult,
        EvaluateInput,
        ModelVersionRef,
        NodeTrainResult,
        Phase,
        RegisterInput,
        RunStatus,
        TrackingInput,
        TrainingRunInput,
    )
    from workflows.contracts.names import CONTROL_TASK_QUEUE
    from workflows.contracts.spec import RunSpec


class RunEnd:
    """The steps of a TrainingRun after training (and the MLflow run beside it)."""

    def __init__(
        self,
        inp: TrainingRunInput,
        status: RunStatus,
        control: Callable[..., Awaitable[Any]],
        set_phase: Callable[[Phase], None],
        decision: Callable[[], Decision | None],
    ) -> None:
        self._input = inp
        self._spec: RunSpec = inp.spec
        self._status = status  # the workflow's own: what these steps set, its query shows
        self._control = control  # one control-worker activity, with patient retries
        self._set_phase = set_phase
        self._decision = decision  # the authorised decision received, if any

    async def evaluate(self, dataset: DatasetRef, checkpoint: CheckpointRef) -> EvalResult:
        self._set_phase(Phase.EVALUATING)
        evaluation = await self._control(
            "evaluate",
            EvaluateInput(
                run_id=self._spec.name, spec=self._spec, dataset=dataset, checkpoint=checkpoint
            ),
            EvalResult,
            timeout=timedelta(hours=2),
            heartbeat=timedelta(minutes=2),
        )
        self._status.evaluation = evaluation
        return evaluation

    async def register(
        self,
        dataset: DatasetRef,
        checkpoint: CheckpointRef,
        evaluation: EvalResult,
        results: list[NodeTrainResult],
    ) -> ModelVersionRef:
        self._set_phase(Phase.REGISTERING)
        version = await self._control(
            "register_model",
            RegisterInput(
                run_id=self._spec.name,
                workflow_run_id=workflow.info().run_id,
                spec=self._spec,
                spec_sha256=self._input.spec_sha256,
                dataset=dataset,
                checkpoint=checkpoint,
                evaluation=evaluation,
                training=results,
                attempts=self._status.attempts,
                goodput=self._status.goodput,
                health=self._status.health,
                mlflow_run_id=self._status.mlflow_run_id,
                code=self._input.code,
            ),
            ModelVersionRef,
            timeout=timedelta(minutes=30),
        )
        self._status.model_version = version
        return version

    async def close_tracking(self, tracking: asyncio.Future[str] | None, status: str) -> None:
        """A run that ends without a model ends its MLflow run too (FAILED, or KILLED when
        cancelled), with the reason. Best effort: MLflow being down must not keep the run from
        ending, so a few tries and no more."""
        if tracking is None or not workflow.patched("close-tracking-run"):
            return
        if not tracking.done():
            tracking.cancel()
            return  # never opened: nothing to close
        if tracking.cancelled() or tracking.exception() is not None:
            return
        close = CloseTrackingInput(
            mlflow_run_id=tracking.result(), status=status, error=self._status.error or ""
        )
        try:
            await workflow.execute_activity(
                "close_tracking_run",
                close,
                task_queue=CONTROL_TASK_QUEUE,
                start_to_close_timeout=timedelta(minutes=1),
                retry_policy=RetryPolicy(maximum_attempts=3),
            )
        except ActivityError:
            workflow.logger.warning("could not end MLflow run %s", close.mlflow_run_id)

    def open_tracking(self) -> asyncio.Task[str] | None:
        """Open the MLflow run that the metrics stream into, beside data preparation."""
        if not workflow.patched("tracking-run"):  # runs started before streaming replay as such
            return None
        opened = self._control(
            "open_tracking_run",
            TrackingInput(
                run_id=self._spec.name,
                workflow_run_id=workflow.info().run_id,
                spec=self._spec,
                spec_sha256=self._input.spec_sha256,
            ),
            str,
            timeout=timedelta(minutes=2),
        )
        return asyncio.ensure_future(opened)

    def tracking_opened(self) -> asyncio.Future[str] | None:
        """A continuation's MLflow run, opened by the run it continues: as the task that
        opened it would be once done, so a failure closes it the same way."""
        if self._status.mlflow_run_id is None:
            return None
        opened: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        opened.set_result(self._status.mlflow_run_id)
        return opened

    async def await_decision(self, version: ModelVersionRef) -> None:
        """Wait for an authorised decision; nobody deciding within the window ends the run."""
        window: timedelta | None = None
        if workflow.patched("approval-rules"):  # earlier runs wait for any decision, forever
            self._status.approval = await self.approval_rules(version.model_name)
            window = timedelta(hours=self._spec.registry.approval_window_hours)
            self._status.approval_deadline = workflow.now() + window
        self._set_phase(Phase.AWAITING_APPROVAL)
        try:
            await workflow.wait_condition(lambda: self._decision() is not None, timeout=window)
        except TimeoutError:
            self._set_phase(Phase.EXPIRED)  # first: a decision arriving now is refused
            expiry = Decision(
                approver="forgeline", approve=False, reason=f"nobody decided within {window}"
            )
            await self._record(version, expiry, expired=True)
            return
        decision = self._decision()
        assert decision is not None
        await self._record(version, decision)
        self._status.decision = decision
        self._set_phase(Phase.APPROVED if decision.approve else Phase.REJECTED)

    async def unvouched(self, version: ModelVersionRef, decision: Decision) -> str | None:
        """Why the API did not vouch for this decision (None: it did). The control worker checks
        the signature: the key cannot be here, the history is readable through Temporal. A
        refusal is kept in the status, naming why; runs and histories from before count any
        decision, as they did."""
        if not workflow.patched("signed-decisions"):
            return None
        check = DecisionCheckInput(
            run_id=self._spec.name, version=version, decision=decision, received_at=workflow.now()
        )
        try:
            checked = await self._control(
                "verify_decision",
                check,
                DecisionCheck,
                timeout=timedelta(minutes=1),
                heartbeat=None,  # one read of a key: bounded by its own minute
            )
        except ActivityError as err:  # the key is unreadable: no decision counts till it is
            cause = getattr(err.cause, "message", None) or str(err)
            return f"the decision could not be checked: {cause}"
        if checked.refused is None:
            return None
        verdict = "an approval" if decision.approve else "a rejection"
        why = f"{verdict} naming {decision.approver} was refused: {checked.refused}"
        entry = f"{workflow.now().isoformat(timespec='seconds')} {why}"
        self._status.refused_decisions = [*self._status.refused_decisions, entry][-20:]
        return why

    async def approval_rules(self, model_name: str) -> ApprovalPolicy:
        """The operators' rules as they are now (registry.approvals), with the spec's gate."""
        policy = await self._control(
            "approval_policy",
            ApprovalPolicyInput(model_name=model_name, team=self._spec.resources.team),
            ApprovalPolicy,
            timeout=timedelta(minutes=5),
        )
        return with_spec(policy, self._spec)

    async def _record(
        self, version: ModelVersionRef, decision: Decision, expired: bool = False
    ) -> None:
        policy = self._status.approval
        tags = gate_tags(policy, self._status.evaluation, decision) if policy else {}
        await self._control(
            "record_decision",
            DecisionInput(
                version=version,
                decision=decision,
                decided_at=workflow.now(),
                tags=tags,
                expired=expired,
            ),
            None,
            timeout=timedelta(minutes=5),
        )
