"""A stand-in for a DatasetSnapshot child workflow whose preparation fails at once, as the real
one does when a source lies outside the data workers' roots. Its own module, so the workflow
sandbox imports nothing but this."""

from __future__ import annotations

from temporalio import workflow
from temporalio.exceptions import ApplicationError

with workflow.unsafe.imports_passed_through():
    from workflows.contracts.models import DatasetInput, DatasetRef

REASON = "SourceError: source /elsewhere/corpus.txt is outside the data roots (/data)"


@workflow.defn(name="DatasetSnapshot")
class FailedDataset:
    @workflow.run
    async def run(self, inp: DatasetInput) -> DatasetRef:
        raise ApplicationError(REASON, non_retryable=True)
