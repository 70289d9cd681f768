"""The `TrainingRun` workflow: one durable state machine per run, from corpus to approval.

Its id is the run name, so submitting the same name twice attaches to the same run. The
workflow decides order, timeouts, retries and waiting; the activities do the work.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import (
    ActivityError,
    ApplicationError,
    ChildWorkflowError,
)

with workflow.unsafe.imports_passed_through():
    from workflows import search_attributes
    from workflows.approval import refusal
    from workflows.cluster_calls import gang_request, nodes_at_fault, report_nodes
    from workflows.contracts.cluster_models import (
        Allocation,
        GangRequest,
        GrantCheck,
        PreemptNotice,
        Release,
    )
    from workflows.contracts.held_items import checkpoint_item
    from workflows.contracts.models import (
        AttemptCause,
        AttemptLedger,
        AttemptLedgerInput,
        AttemptOutcome,
        AttemptRecord,
        CheckpointRef,
        DatasetInput,
        DatasetRef,
        Decision,
        Failure,
        FenceInput,
        HealthEvent,
        InitFromInput,
        LatestCheckpointInput,
        NodeTrainResult,
        Phase,
        PreemptionRecord,
        RunCarry,
        RunStatus,
        TrainingRunInput,
    )
    from workflows.contracts.names import (
        CLUSTER_WORKFLOW_ID,
        CONTROL_TASK_QUEUE,
        GANG_GRANTED_SIGNAL,
        HEALTH_SIGNAL,
        PREEMPT_SIGNAL,
        dataset_workflow_id,
    )
    from workflows.gang_attempt import run_gang
    from workflows.gang_outcome import (
        GangFailed,
        Preempted,
        StragglerSwap,
        describe,
    )
    from workflows.run_end import RunEnd
    from workflows.run_records import (
        add_attempt,
        add_failures,
        add_preemption,
        add_skipped,
        add_suspects,
        failed_in_a_row,
        newest,
        rewound,
    )
    from workflows.scheduling.node_reports import RANK_REPORTED
    from workflows.silent_nodes import Confirmation, confirm
    from workflows.suspect_rollback import rollback_step

# Activities that only talk to the store or MLflow retry until they succeed: an outage of the
# tracking server or a bug fixed by redeploying the worker costs time, never the trained model.
# Bad input and corrupt data fail at once (activities raise them as non-retryable).
_PATIENT_RETRY = RetryPolicy(
    initial_interval=timedelta(seconds=1), maximum_interval=timedelta(minutes=1)
)
# A control activity beats every few seconds: one whose worker died is retried within this,
# not at its start-to-close timeout (a run sat REGISTERING for 30 minutes: bench/soak.py).
CONTROL_HEARTBEAT = timedelta(seconds=30)


@workflow.defn(name="TrainingRun")
class TrainingRun:
    @workflow.init
    def __init__(self, inp: TrainingRunInput) -> None:
        self._input = inp
        self._spec = inp.spec
        carried = inp.carried
        self._status = (
            carried.status
            if carried
            else RunStatus(
                name=inp.spec.name,
                phase=Phase.PREPARING,
                owner=inp.spec.owner,
                # A script that keeps its own checkpoints counts its own steps: none to show.
                total_steps=0 if inp.spec.train.keeps_its_own_checkpoints else inp.spec.train.steps,
                spec_sha256=inp.spec_sha256,
                team=inp.spec.resources.team,
                model_name=inp.spec.model_name,
            )
        )
        # When the run was submitted: its age in the queue, kept across continue-as-new.
        self._submitted_at = carried.submitted_at if carried else workflow.info().start_time
        self._grant: Allocation | None = None
        self._allocation: Allocation | None = None
        # Grants of this or an older generation are stale.
        self._newest_generation = carried.newest_generation if carried else 0
        # Every grant received, checked against the Cluster's allocations before it is used.
        self._offered: list[Allocation] = []
        self._newest_confirmed = carried.newest_confirmed if carried else 0
        self._preempt: PreemptNotice | None = None
        self._decision: Decision | None = None
        self._attempt: AttemptRecord | None = None  # the gang attempt under way
        # What the next attempt follows: start, failure, preemption, swap.
        self._after = carried.after if carried else AttemptCause.START
        self._queued_with_release = False  # the last release queued the next attempt
        # The probes of nodes taken for dead that may yet answer (workflows.silent_nodes).
        self._confirming: list[asyncio.Task[bool]] = []
        # Where the first gang starts, when a person asked (forgeline resume --from); None
        # once it has been fenced there, and the newest checkpoint is this lineage's again.
        self._resume_from = inp.resume_from_step
        # Evaluation, registration and the decision; the MLflow run beside the whole run.
        self._end = RunEnd(inp, self._status, self._control, self._set_phase, self._decided)

    @workflow.run
    async def run(self, inp: TrainingRunInput) -> RunStatus:
        try:
            if inp.carried is None:
                tracking = self._end.open_tracking()  # while the data is prepared
                dataset = await self._prepare()
                if self._spec.model.init_from:
                    self._status.init_from = await self._resolve_init_from(dataset)
                if tracking is not None:
                    self._status.mlflow_run_id = await tracking
            else:  # a continuation: preparation and the MLflow run are done, in the status
                tracking = self._end.tracking_opened()
                assert self._status.dataset is not None
                dataset = self._status.dataset
            checkpoint, results = await self._train(dataset)
            evaluation = await self._end.evaluate(dataset, checkpoint)
            version = await self._end.register(dataset, checkpoint, evaluation, results)
            await self._end.await_decision(version)
            await self._settle_confirmations()
        except asyncio.CancelledError:
            self._set_phase(Phase.CANCELLED)
            await self._release_gang()
            await self._end.close_tracking(tracking, "KILLED")
            raise
        except (ActivityError, ApplicationError, ChildWorkflowError) as err:
            # A failed dataset snapshot (a child workflow) used to fail the run bare: its status
            # said PREPARING forever, with no error. Histories from then replay as they were.
            if isinstance(err, ChildWorkflowError) and not workflow.patched("child-failure"):
                raise
            self._status.error = describe(err)
            self._set_phase(Phase.FAILED)
            await self._release_gang()
            await self._settle_confirmations()
            await self._end.close_tracking(tracking, "FAILED")
            raise ApplicationError(f"run {self._spec.name} failed: {self._status.error}") from err
        return self._status

    # --- interface -------------------------------------------------------------------------

    @workflow.query
    def status(self) -> RunStatus:
        return self._status

    @workflow.signal(name=GANG_GRANTED_SIGNAL)
    def gang_granted(self, allocation: Allocation) -> None:
        if allocation.run_id == self._spec.name:
            self._offered.append(allocation)
        if allocation.run_id == self._spec.name and allocation.generation > self._newest_generation:
            self._newest_generation = allocation.generation
            self._grant = allocation

    @workflow.signal(name=PREEMPT_SIGNAL)
    def preempt(self, notice: PreemptNotice) -> None:
        current = self._allocation
        if current is not None and notice.generation == current.generation:
            self._preempt = notice

    @workflow.signal(name=HEALTH_SIGNAL)
    def health_event(self, event: HealthEvent) -> None:
        """A node agent's report of what the gang's health checks found; only the current
        generation's count (fencing)."""
        current = self._allocation
        if current is not None and event.generation == current.generation:
            self._status.health = newest(self._status.health, [event])

    @workflow.update
    async def decide(self, decision: Decision) -> RunStatus:
        version = self._status.model_version
        # Anyone who reaches Temporal can send this update naming anyone: only a decision the
        # API signed for the person its token names counts. A refusal fails this update only.
        if version is not None and (why := await self._end.unvouched(version, decision)):
            raise ApplicationError(why)
        if self._status.approval is not None and version is not None:
            # The rules as they are now: an approver listed while the model waited counts, one
            # removed no longer does. A refusal fails this update, not the run.
            self._status.approval = await self._end.approval_rules(version.model_name)
            if why := refusal(self._status, self._decision is not None, decision):
                raise ApplicationError(why)
        self._decision = decision
        await workflow.wait_condition(lambda: self._status.phase.final)
        return self._status

    @decide.validator
    def _validate_decision(self, decision: Decision) -> None:
        if why := refusal(self._status, self._decision is not None, decision, rules=False):
            raise ApplicationError(why)

    # --- phases ----------------------------------------------------------------------------

    async def _control(
        self,
        activity: str,
        arg: object,
        result_type: type | None,
        timeout: timedelta,
        heartbeat: timedelta | None = CONTROL_HEARTBEAT,
    ) -> Any:
        """Run one activity on the control worker with the patient retry policy; it beats
        (activities.heartbeat.beats_while_running) unless `heartbeat` is None."""
        return await workflow.execute_activity(
            activity,
            arg,
            result_type=result_type,
            task_queue=CONTROL_TASK_QUEUE,
            start_to_close_timeout=timeout,
            heartbeat_timeout=heartbeat,
            retry_policy=_PATIENT_RETRY,
        )

    async def _prepare(self) -> DatasetRef:
        """A child workflow: its stages fan out on the data workers and show in the UI."""
        self._set_phase(Phase.PREPARING)
        self._status.dataset_workflow_id = dataset_workflow_id(self._spec.name)
        dataset = await workflow.execute_child_workflow(
            "DatasetSnapshot",
            DatasetInput(data=self._spec.data, requested_by=self._spec.name),
            id=self._status.dataset_workflow_id,
            task_queue=CONTROL_TASK_QUEUE,
            result_type=DatasetRef,
        )
        self._status.dataset = dataset
        return dataset

    async def _train(self, dataset: DatasetRef) -> tuple[CheckpointRef, list[NodeTrainResult]]:
        while True:
            await self._continue_as_new_if_due()
            self._set_phase(Phase.QUEUED if self._status.attempts == 0 else Phase.RECOVERING)
            allocation = await self._acquire_gang()
            # Fenced: from here on, older generations' late commits do not count (nor, after
            # a resume --from, their commits past the step it resumed from).
            resume = await self._latest_checkpoint(
                allocation.generation, fence=True, at_most_step=self._resume_from
            )
            self._resume_from = None
            self._status.last_checkpoint = resume
            self._set_phase(Phase.TRAINING)
            try:
                results = await run_gang(
                    self._input, self._status, allocation, dataset, resume, lambda: self._preempt
                )
            except GangFailed as failed:
                await self._close_attempt(AttemptOutcome.FAILED, kept_step=None)
                await self._recover(allocation, failed.failures, failed.confirmations)
                continue
            except StragglerSwap as swap:
                # Not a failure either: the gang checkpointed; its slow node is cordoned and
                # the run continues at once on a spare (or the next compatible node).
                await self._close_attempt(AttemptOutcome.SWAPPED, kept_step=swap.step)
                await self._swap(allocation, swap)
                continue
            except Preempted as preempted:
                if preempted.notice.grow_to is not None:
                    # A shrunk gang checkpointed to grow back: the cluster holds the full
                    # gang's nodes for the request the release carries.
                    await self._close_attempt(AttemptOutcome.REGROWN, kept_step=preempted.step)
                    self._after = AttemptCause.GROW
                    await self._release_gang(requeue=True)
                    continue
                # Not a failure: no attempt is spent and no backoff; the run queues again with
                # its original age and resumes from the checkpoint it just committed.
                await self._close_attempt(AttemptOutcome.PREEMPTED, kept_step=preempted.step)
                self._after = AttemptCause.PREEMPTION
                add_preemption(
                    self._status,
                    PreemptionRecord(
                        generation=allocation.generation,
                        reason=preempted.notice.reason,
                        at=workflow.now(),
                        step=preempted.step,
                    ),
                )
                await self._release_gang()
                continue
            await self._close_attempt(AttemptOutcome.COMPLETED, kept_step=self._spec.train.steps)
            await self._release_gang()
            final = await self._latest_checkpoint(allocation.generation)
            # A script that keeps its own checkpoints ends at whatever step its commits reached.
            if final is None or (
                self._spec.train.checkpoints == "sdk" and final.step < self._spec.train.steps
            ):
                raise ApplicationError(
                    f"training finished but the store holds no committed checkpoint at step "
                    f"{self._spec.train.steps} (found {final.step if final else 'none'})",
                    non_retryable=True,
                )
            self._status.last_checkpoint = final
            head = results[0]
            self._status.final_loss = head.final_loss
            self._status.tokens_per_s = head.tokens_per_s
            self._status.mfu = head.mfu
            return final, results

    def _gang_request(self) -> GangRequest:
        dataset = self._status.dataset
        return gang_request(
            self._spec,
            dataset.snapshot_id if dataset else None,
            # After a failure or a swap the gang may take a spare or (elastic) shrink; growing
            # back too, should the nodes held for it be gone (a node died meanwhile).
            recovering=self._after in (AttemptCause.FAILURE, AttemptCause.SWAP, AttemptCause.GROW),
            submitted_at=self._submitted_at,
            started_before=bool(self._status.gang_attempts),
            needs=self._needs(),
            base_model=self._status.init_from.manifest_key if self._status.init_from else None,
            avoid=self._avoided(),
        )

    def _avoided(self) -> list[str]:
        """The nodes its ranks reported: its gangs go elsewhere, since the cluster no longer
        cordons a node on one run's word (workflows.scheduling.node_reports)."""
        if not self._status.suspect_nodes or not workflow.patched("avoid-reported-nodes"):
            return []
        return list(self._status.suspect_nodes)

    def _needs(self) -> dict[str, int]:
        """What each node of the gang will fetch, by id with bytes: the dataset, and the base
        model until the run has a checkpoint of its own (it resumes from that instead)."""
        needs: dict[str, int] = {}
        if (dataset := self._status.dataset) is not None:
            needs[dataset.snapshot_id] = dataset.bytes
        base = self._status.init_from
        if base is not None and self._status.last_checkpoint is None:
            needs[checkpoint_item(base.manifest_key)] = base.bytes
        return needs

    async def _acquire_gang(self) -> Allocation:
        self._grant = None
        self._preempt = None
        requested_at = workflow.now()
        if self._queued_with_release:
            self._queued_with_release = False  # the release carried the request (_release_gang)
        else:
            cluster = workflow.get_external_workflow_handle(CLUSTER_WORKFLOW_ID)
            await cluster.signal("request_gang", self._gang_request())
        if workflow.patched("grants-confirmed"):  # runs started before take grants unchecked
            self._grant = await self._confirmed_grant()
        else:
            await workflow.wait_condition(lambda: self._grant is not None)
        assert self._grant is not None
        self._allocation = self._grant
        self._attempt = AttemptRecord(
            generation=self._grant.generation,
            gpus=len(self._grant.nodes) * self._spec.resources.gpus_per_node,
            requested_at=requested_at,
            granted_at=workflow.now(),
            after=self._after,
        )
        self._status.generation = self._grant.generation
        self._status.nodes = [n.node_id for n in self._grant.nodes]
        wanted = self._spec.resources.nodes
        self._status.shrunk_from = wanted if len(self._grant.nodes) < wanted else None
        return self._grant

    async def _confirmed_grant(self) -> Allocation:
        """The next grant the Cluster workflow itself holds for this run: anyone who reaches
        Temporal can signal a run, so a grant it did not make (other nodes, a made-up
        generation) is refused, noted in the status, and changes nothing."""
        while True:
            await workflow.wait_condition(lambda: bool(self._offered))
            offer = self._offered.pop(0)
            if offer.generation <= self._newest_confirmed:
                continue  # stale, or a duplicate of one already used
            check = GrantCheck.of(offer)  # its nodes, their agents and addresses
            # Async and bounded by its own 30 s: it does not beat.
            if await self._control("confirm_grant", check, bool, timedelta(seconds=30), None):
                self._newest_confirmed = offer.generation
                return offer
            nodes = ", ".join(n.node_id for n in offer.nodes)
            refused = (
                f"a grant of generation {offer.generation} on {nodes}: not an allocation the "
                "cluster holds (forged, or revoked before it was used)"
            )
            self._status.refused_grants = [*self._status.refused_grants, refused][-5:]

    async def _close_attempt(self, outcome: AttemptOutcome, kept_step: int | None) -> None:
        """The attempt is over: add what its ranks recorded of their time, and recount goodput."""
        attempt = self._attempt
        if attempt is None:
            return
        self._attempt = None
        attempt.ended_at = workflow.now()
        attempt.outcome = outcome
        if workflow.patched("attempt-ledger"):  # runs started before goodput replay without it
            attempt.ledger = await self._ledger(attempt.generation, kept_step)
            await self._recount_rewound(attempt)
        add_attempt(self._status, attempt)
        if self._spec.train.keeps_its_own_checkpoints:
            # Its ranks keep no ledger of their time (the script never imports forgeline): a
            # goodput counted without one would book every second as lost. None is the truth.
            self._status.goodput = None

    async def _recount_rewound(self, attempt: AttemptRecord) -> None:
        """An attempt that resumed from an older checkpoint than an earlier attempt kept (the
        newer was a peer copy the gang could not assemble): the earlier one's steps since are
        rework, not productive. Its ledger is read again, kept at most at the resume step."""
        if attempt.ledger is None:
            return
        resume_step = attempt.ledger.resume_step
        for earlier in rewound(self._status, resume_step):
            if not workflow.patched("fallback-rework"):  # histories before it never came here
                return
            earlier.ledger = await self._ledger(earlier.generation, resume_step, at_most=True)

    async def _ledger(
        self, generation: int, kept_step: int | None, at_most: bool = False
    ) -> AttemptLedger | None:
        """What a generation's ranks recorded of their time (the `attempt_ledger` activity)."""
        inp = AttemptLedgerInput(
            run_id=self._spec.name, generation=generation, kept_step=kept_step, kept_at_most=at_most
        )
        return await self._control(
            "attempt_ledger", inp, AttemptLedger | None, timeout=timedelta(minutes=5)
        )

    async def _release_gang(self, requeue: bool = False) -> None:
        """Give back the gang, and withdraw a request still waiting in the queue (generation 0
        matches no allocation, so it only withdraws). `requeue`: the release carries the next
        attempt's request, so the cluster frees the nodes and queues the run in one step and no
        pass in between hands the survivors to the queue (patch requeue-with-release)."""
        generation = self._allocation.generation if self._allocation else 0
        self._allocation = None
        self._status.nodes = []
        self._queued_with_release = requeue
        release = Release(
            run_id=self._spec.name,
            generation=generation,
            requeue=self._gang_request() if requeue else None,
        )
        await workflow.get_external_workflow_handle(CLUSTER_WORKFLOW_ID).signal("release", release)

    async def _resolve_init_from(self, dataset: DatasetRef) -> CheckpointRef:
        """Fine-tuning: pin the starting weights once, so every attempt starts from the same."""
        model = self._spec.model
        return await self._control(
            "resolve_init_from",
            InitFromInput(
                source=model.init_from or "",
                architecture={**model.architecture(), "vocab_size": dataset.vocab_size},
                team=self._spec.resources.team,
            ),
            CheckpointRef,
            timeout=timedelta(minutes=10),
        )

    async def _latest_checkpoint(
        self, generation: int, fence: bool = False, at_most_step: int | None = None
    ) -> CheckpointRef | None:
        """The checkpoint to use: the newest that verifies (for a new gang, `fence`: a newer
        peer-tier one wins, and the generation is fenced at its step before it starts)."""
        # The lookup and the fence are two activities; runs from before did both in one.
        apart = fence and workflow.patched("fence-apart")
        found = await self._control(
            "latest_checkpoint",
            LatestCheckpointInput(
                run_id=self._spec.name,
                max_generation=generation,
                fence=fence and not apart,
                for_new_gang=apart,
                run_uid=self._input.run_uid,
                at_most_step=at_most_step,
            ),
            CheckpointRef | None,
            timeout=timedelta(minutes=10),
        )
        if apart:
            fence_at = FenceInput(
                run_id=self._spec.name,
                generation=generation,
                resume_step=found.step if found else 0,
                run_uid=self._input.run_uid,
            )
            await self._control("fence_generation", fence_at, None, timeout=timedelta(minutes=10))
        if found is not None:  # what was passed over stays on record, once
            add_skipped(self._status, found.skipped)
        return found

    async def _recover(
        self, allocation: Allocation, failures: list[Failure], out: list[Confirmation]
    ) -> None:
        """Drain the nodes at fault, give the gang back, and back off if failures repeat."""
        self._set_phase(Phase.RECOVERING)
        self._after = AttemptCause.FAILURE
        add_failures(self._status, failures)
        generation = allocation.generation
        blamed = nodes_at_fault(failures, self._status.health, generation)
        await report_nodes(self._spec.name, generation, blamed)
        # Reported down first, so an answer that comes later is what brings the node back.
        reported = {node: reason for node, reason, _ in blamed}
        self._confirming += [
            asyncio.create_task(confirm(self._spec.name, generation, c, reported[c.node.node_id]))
            for c in out
        ]
        add_suspects(self._status, [node for node, _, kind in blamed if kind in RANK_REPORTED])
        before = rollback_step(self._status.health, blamed, generation)
        if before is not None and workflow.patched("rollback-before-suspect"):
            # The checkpoints since the quarantined node's first suspect may hold its errors.
            self._resume_from = before
        in_a_row = failed_in_a_row(self._status)
        gives_up = self._status.attempts + 1 > self._spec.recovery.max_restarts
        # Queued again in the release itself unless it gives up or backs off first.
        requeue = in_a_row <= 1 and not gives_up and workflow.patched("requeue-with-release")
        await self._release_gang(requeue=requeue)
        self._status.attempts += 1
        if gives_up:
            raise ApplicationError(
                f"gave up after {self._status.attempts} failed attempts "
                f"(recovery.max_restarts = {self._spec.recovery.max_restarts}); "
                f"last failure: {failures[-1].reason}",
                non_retryable=True,
            )
        if workflow.patched("first-retry-at-once"):
            # A node died: the run queues again at once (a spare or a free node is granted
            # within the second). Failures one after another back off: 1 s, 2 s, ... 30 s.
            if in_a_row > 1:
                await workflow.sleep(timedelta(seconds=min(2 ** (in_a_row - 2), 30)))
        else:
            await workflow.sleep(timedelta(seconds=min(2 ** (self._status.attempts - 1), 30)))

    async def _swap(self, allocation: Allocation, swap: StragglerSwap) -> None:
        """Cordon the straggler's node (the cluster keeps its evidence as the reason), give the
        gang back and queue again for one without it."""
        self._set_phase(Phase.RECOVERING)
        self._after = AttemptCause.SWAP
        self._status.swaps += 1
        event = swap.event
        if event.node_id is not None:
            slow = [(event.node_id, f"straggler: {event.evidence}", "straggler")]
            await report_nodes(self._spec.name, allocation.generation, slow)
            add_suspects(self._status, [event.node_id])
        await self._release_gang(requeue=workflow.patched("requeue-with-release"))

    async def _settle_confirmations(self) -> None:
        """Wait for the probes still out for nodes taken for dead (workflows.silent_nodes):
        before the history is handed on or the run ends, so no node is left down that
        answered."""
        if self._confirming:
            await asyncio.gather(*self._confirming)
            self._confirming = []

    async def _continue_as_new_if_due(self) -> None:
        """Between gang attempts (no gang held), start a fresh history once the server
        suggests it: every attempt adds activities, signals and timers, and a run preempted or
        restarted often enough would reach Temporal's history limit. The status, already
        bounded (workflows.run_records), travels whole. A request its last release queued
        (requeue-with-release) is asked for again by the fresh run: the cluster keeps one
        request per run and resends a grant it already made."""
        if not self._status.gang_attempts or not workflow.patched("continue-as-new"):
            return
        if not workflow.info().is_continue_as_new_suggested():
            return
        await self._settle_confirmations()
        self._status.continued += 1
        carry = RunCarry(
            status=self._status,
            submitted_at=self._submitted_at,
            newest_generation=self._newest_generation,
            newest_confirmed=self._newest_confirmed,
            after=self._after,
        )
        # resume_from_step was spent on the first gang (there has been one: gang_attempts);
        # what is left is a rollback a corruption verdict asked of the next gang.
        workflow.continue_as_new(
            self._input.model_copy(update={"carried": carry, "resume_from_step": self._resume_from})
        )

    def _decided(self) -> Decision | None:
        """The authorised decision `decide` received, if any (what `RunEnd` waits for)."""
        return self._decision

    def _set_phase(self, phase: Phase) -> None:
        self._status.phase = phase
        self._status.updated_at = workflow.now()
        if workflow.patched("search-attributes"):  # filterable in the Temporal UI
            spec = self._spec
            workflow.upsert_search_attributes(
                [
                    search_attributes.TEAM.value_set(spec.resources.team),
                    search_attributes.MODEL.value_set(spec.model_name),
                    search_attributes.OWNER.value_set(spec.owner),
                    search_attributes.PHASE.value_set(phase.value),
                ]
            )
