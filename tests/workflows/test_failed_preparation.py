"""A run whose dataset snapshot fails says so: FAILED, with the reason. Before, the child
workflow's failure failed the run bare, and `forgeline status` said PREPARING forever (seen by
hand: a source outside the data roots on the local stack)."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import pytest
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import Worker

from tests.workflows.failed_dataset import REASON, FailedDataset
from tests.workflows.test_training_run_history import Control, Node, _status
from worker.specfile import load_spec
from workflows.contracts.models import Phase, RunStatus, TrainingRunInput
from workflows.contracts.names import CONTROL_TASK_QUEUE
from workflows.training_run import TrainingRun

REPO = Path(__file__).resolve().parents[2]


def test_a_failed_dataset_snapshot_fails_the_run_with_its_reason(temporal_address: str) -> None:
    spec = load_spec(REPO / "examples" / "tiny.toml").model_copy(update={"name": "no-data"})

    async def main() -> tuple[RunStatus, WorkflowExecutionStatus | None]:
        client = await Client.connect(temporal_address, data_converter=pydantic_data_converter)
        worker = Worker(
            client,
            task_queue=CONTROL_TASK_QUEUE,
            workflows=[TrainingRun, FailedDataset],
            activities=Control(Node()).all(),
        )
        async with contextlib.AsyncExitStack() as stack:
            await stack.enter_async_context(worker)
            handle = await client.start_workflow(
                TrainingRun.run,
                TrainingRunInput(spec=spec, spec_sha256="0" * 64),
                id=spec.name,
                task_queue=CONTROL_TASK_QUEUE,
            )
            with pytest.raises(Exception, match="failed"):
                await asyncio.wait_for(handle.result(), 60)
            status = await _status(handle)
            return status, (await handle.describe()).status

    status, execution = asyncio.run(main())
    assert execution == WorkflowExecutionStatus.FAILED
    assert status.phase == Phase.FAILED, status.phase
    assert status.error == REASON, status.error
