"""The `DatasetSnapshot` workflow: data preparation fanned out over chunks on data workers.

    plan → scan (every chunk) → dedup → tokenizer → tokenize (every chunk) → commit

Each activity is idempotent (a chunk whose done-record verifies is skipped), so a retried or
restarted stage redoes only unfinished chunks. More data workers polling the data task queue
means more chunks at once. The `progress` query reports done/total per stage.
"""

from __future__ import annotations

import asyncio
import dataclasses
from datetime import timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError, RetryState
from temporalio.exceptions import TimeoutError as ActivityTimedOut

with workflow.unsafe.imports_passed_through():
    from workflows.contracts.models import (
        DatasetInput,
        DatasetPlanRef,
        DatasetProgress,
        DatasetRef,
        DataStageInput,
        StageProgress,
    )
    from workflows.contracts.names import DATA_TASK_QUEUE

STAGES = ("plan", "scan", "dedup", "tokenizer", "tokenize", "commit")
_RETRY = RetryPolicy(initial_interval=timedelta(seconds=1), maximum_interval=timedelta(minutes=1))


@workflow.defn(name="DatasetSnapshot")
class DatasetSnapshotWorkflow:
    @workflow.init
    def __init__(self, inp: DatasetInput) -> None:
        self._progress = DatasetProgress(stages=[StageProgress(name=s) for s in STAGES])
        self._input = inp

    @workflow.query
    def progress(self) -> DatasetProgress:
        return self._progress

    @workflow.run
    async def run(self, inp: DatasetInput) -> DatasetRef:
        (plan,) = await self._stage("plan", [inp], "plan_dataset", DatasetPlanRef)
        self._progress.snapshot_id = plan.snapshot_id
        if plan.existing is not None:
            for stage in self._progress.stages:
                stage.done = stage.total = stage.total or 1
            return plan.existing

        def each_chunk() -> list[DataStageInput]:
            return [
                DataStageInput(snapshot_id=plan.snapshot_id, data=inp.data, chunk=c)
                for c in range(plan.chunks)
            ]

        once = [DataStageInput(snapshot_id=plan.snapshot_id, data=inp.data)]
        await self._stage("scan", each_chunk(), "scan_chunk", None)
        await self._stage("dedup", once, "dedup_dataset", None)
        await self._stage("tokenizer", once, "train_tokenizer", None)
        await self._stage("tokenize", each_chunk(), "tokenize_chunk", None)
        (dataset,) = await self._stage("commit", once, "commit_dataset", DatasetRef)
        return dataset

    async def _stage(
        self, name: str, inputs: list, activity: str, result_type: type | None
    ) -> list:
        """Run one activity per input, all at once, counting completions for `progress`."""
        stage = next(s for s in self._progress.stages if s.name == name)
        stage.total = len(inputs)

        # Bounded since the patch: a record that kills every worker that reads it (out of
        # memory) was retried for ever; now the snapshot fails, naming where the worker was.
        bounded = workflow.patched("bounded-data-retries")
        heartbeat, retry = timedelta(minutes=2), _RETRY
        if bounded:
            heartbeat = timedelta(seconds=self._input.worker_heartbeat_timeout_s)
            retry = dataclasses.replace(_RETRY, maximum_attempts=self._input.max_attempts)

        async def one(arg: object) -> object:
            try:
                result = await workflow.execute_activity(
                    activity,
                    arg,
                    result_type=result_type,
                    task_queue=DATA_TASK_QUEUE,
                    start_to_close_timeout=timedelta(hours=6),
                    heartbeat_timeout=heartbeat,
                    retry_policy=retry,
                )
            except ActivityError as err:
                if bounded and err.retry_state == RetryState.MAXIMUM_ATTEMPTS_REACHED:
                    raise _gave_up(name, arg, err, retry.maximum_attempts) from err
                raise
            stage.done += 1
            return result

        return list(await asyncio.gather(*(one(arg) for arg in inputs)))


def _gave_up(stage: str, arg: object, err: ActivityError, attempts: int) -> ApplicationError:
    """The stage's last failure, with what its worker last reported doing (the file and record
    the scan was reading) when the worker stopped answering rather than failing."""
    chunk = getattr(arg, "chunk", None)
    what = f"the {stage} stage" + (f" of chunk {chunk}" if chunk is not None else "")
    cause = err.cause
    if isinstance(cause, ActivityTimedOut):
        details = cause.last_heartbeat_details
        last = str(details[0]) if details else "nothing"
        message = (
            f"{what} failed {attempts} times: its data worker stopped answering each time (it "
            f"died, out of memory or killed, or hung); it last reported: {last}. Remove or fix "
            "that record (or give the data workers more memory), then run again"
        )
    else:
        message = f"{what} failed {attempts} times; the last time: {cause or err}"
    return ApplicationError(message, type="DataStageFailed", non_retryable=True)
