"""A stand-in for the DatasetSnapshot child workflow in TrainingRun tests: the snapshot is
already there. Its own module, so the workflow sandbox imports nothing but this."""

from __future__ import annotations

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from workflows.contracts.models import DatasetInput, DatasetRef

DATASET = DatasetRef(
    snapshot_id="0" * 16, manifest_key="datasets/x/MANIFEST.json", manifest_sha256="0" * 64,
    vocab_size=65, train_tokens=1000, val_tokens=100, documents=10, duplicates_removed=0,
)  # fmt: skip


@workflow.defn(name="DatasetSnapshot")
class PreparedDataset:
    @workflow.run
    async def run(self, inp: DatasetInput) -> DatasetRef:
        return DATASET
