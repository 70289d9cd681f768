"""The DatasetSnapshot workflow on a real dev server, with the real data activities."""

from __future__ import annotations

import asyncio
import json
import re
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from temporalio import activity
from temporalio.client import Client, WorkflowFailureError
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import Worker

from activities.data import DataActivities
from infra.settings import Settings
from infra.store.factory import open_store
from infra.store.local import LocalStore
from tests.conftest import SHAKESPEARE
from workflows.contracts.models import DatasetInput, DatasetProgress, DatasetRef, DataStageInput
from workflows.contracts.names import DATA_TASK_QUEUE
from workflows.contracts.spec import DataSpec, FilterSpec
from workflows.dataset import STAGES, DatasetSnapshotWorkflow


def run_dataset(
    address: str,
    task_queue: str,
    home: Path,
    data: DataSpec,
    store_url: str = "",
    data_roots: str = "",
):
    async def main() -> tuple[DatasetRef, DatasetProgress]:
        client = await Client.connect(address, data_converter=pydantic_data_converter)
        settings = Settings(home=home, store_url=store_url, data_roots=data_roots)
        activities = DataActivities(settings)
        with ThreadPoolExecutor(2) as pool:
            async with (
                Worker(client, task_queue=task_queue, workflows=[DatasetSnapshotWorkflow]),
                Worker(
                    client,
                    task_queue=DATA_TASK_QUEUE,
                    activities=activities.all(),
                    activity_executor=pool,
                ),
            ):
                handle = await client.start_workflow(
                    DatasetSnapshotWorkflow.run,
                    DatasetInput(data=data, requested_by="test"),
                    id=f"dataset-test-{uuid.uuid4().hex[:8]}",
                    task_queue=task_queue,
                )
                result = await handle.result()
                progress = await handle.query(
                    DatasetSnapshotWorkflow.progress, result_type=DatasetProgress
                )
                return result, progress

    return asyncio.run(main())


@pytest.fixture
def three_files(tmp_path: Path) -> Path:
    """Three 600 KB files: with chunk_mb = 1, three chunks."""
    folder = tmp_path / "corpus"
    folder.mkdir()
    text = SHAKESPEARE.read_text()
    for i in range(3):
        part = text[(i * 300_000) % 800_000 :][:300_000]
        (folder / f"part-{i}.txt").write_text(part + "\n\n" + part)
    return folder


def test_stages_fan_out_over_chunks_and_a_second_run_reuses(
    temporal_address: str, task_queue: str, tmp_path: Path, three_files: Path
) -> None:
    data = DataSpec(sources=[str(three_files)], filters=FilterSpec(min_words=1), chunk_mb=1)
    dataset, progress = run_dataset(
        temporal_address, task_queue, tmp_path / "home", data, data_roots=str(tmp_path)
    )
    assert not dataset.reused and dataset.train_tokens > 0 and dataset.val_tokens > 0
    # Each file repeats its first half, and files overlap: exact dedup removes the copies.
    assert dataset.duplicates_removed > dataset.documents / 3
    assert [s.name for s in progress.stages] == list(STAGES)
    totals = {s.name: (s.done, s.total) for s in progress.stages}
    assert totals == {"plan": (1, 1), "scan": (3, 3), "dedup": (1, 1), "tokenizer": (1, 1),
                      "tokenize": (3, 3), "commit": (1, 1)}  # fmt: skip
    store = LocalStore(tmp_path / "home" / "store")
    assert store.exists(dataset.manifest_key)

    again, _ = run_dataset(
        temporal_address, task_queue, tmp_path / "home", data, data_roots=str(tmp_path)
    )
    assert again.reused and again.manifest_sha256 == dataset.manifest_sha256


def test_bad_input_fails_the_workflow_at_once_with_the_reason(
    temporal_address: str, task_queue: str, tmp_path: Path
) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{broken\n" * 20)
    data = DataSpec(sources=[str(bad)])
    with pytest.raises(WorkflowFailureError) as raised:
        run_dataset(temporal_address, task_queue, tmp_path / "home", data, data_roots=str(tmp_path))
    cause = raised.value.cause
    while getattr(cause, "cause", None) is not None:
        cause = cause.cause
    assert "bad.jsonl: 20 of 20 records are bad" in str(cause)
    assert "data.max_bad_fraction" in str(cause)


def test_a_link_out_of_the_data_roots_fails_the_snapshot_before_anything_is_read(
    temporal_address: str, task_queue: str, tmp_path: Path, three_files: Path
) -> None:
    """The data worker reads only inside its data roots. Before, the link's target (another
    team's file, or /proc/self/environ) was read and committed as shards of the dataset."""
    secret = tmp_path / "another-team" / "keys.txt"
    secret.parent.mkdir()
    secret.write_text("AWS_SECRET_ACCESS_KEY=" + "x" * 40 + "\n")
    (three_files / "notes.txt").symlink_to(secret)
    data = DataSpec(sources=[str(three_files)], filters=FilterSpec(min_words=1))
    with pytest.raises(WorkflowFailureError) as raised:
        run_dataset(temporal_address, task_queue, tmp_path / "home", data,
                    data_roots=str(three_files))  # fmt: skip
    cause = raised.value.cause
    while getattr(cause, "cause", None) is not None:
        cause = cause.cause
    assert f"source {three_files}/notes.txt is a link to {secret}, outside the data roots" in str(
        cause
    )
    assert not LocalStore(tmp_path / "home" / "store").list("datasets/")


def test_a_corpus_uploaded_to_the_runs_s3_store_is_read_by_its_key(
    temporal_address: str, task_queue: str, tmp_path: Path, raw, bucket: str
) -> None:
    # Uploaded with the bucket's own tools (no sha256 metadata), next to where snapshots go.
    text = SHAKESPEARE.read_text()[:100_000]
    for i in range(2):
        key = f"store/corpora/shakespeare/part-{i}.txt"
        raw.put_object(Bucket=bucket, Key=key, Body=text[i * 50_000 :][:50_000].encode())
    data = DataSpec(sources=["store:corpora/shakespeare/"], filters=FilterSpec(min_words=1))
    home, store_url = tmp_path / "home", f"s3://{bucket}/store"
    dataset, _ = run_dataset(temporal_address, task_queue, home, data, store_url)
    assert not dataset.reused and dataset.train_tokens > 0 and dataset.val_tokens > 0
    manifest = json.loads(open_store(store_url).get_bytes(dataset.manifest_key))
    assert [s["path"] for s in manifest["sources"]] == [
        f"s3://{bucket}/store/corpora/shakespeare/part-{i}.txt" for i in range(2)
    ]
    assert len(list((home / "data-work" / "data" / "source-cache").rglob("object.txt"))) == 2
    again, _ = run_dataset(temporal_address, task_queue, home, data, store_url)
    assert again.reused and again.snapshot_id == dataset.snapshot_id


@activity.defn(name="scan_chunk")
async def _dies_on_a_record(inp: DataStageInput) -> None:
    """A data worker killed (out of memory) on a record: it said where it was, then went
    silent. Killing a real worker's process every attempt is what this stands in for."""
    activity.heartbeat(f"chunk {inp.chunk}: /corpus/poison.jsonl record 7 (9,000,000 characters)")
    await asyncio.sleep(60)


def test_a_record_that_kills_every_worker_fails_the_snapshot_naming_it(
    temporal_address: str, task_queue: str, tmp_path: Path, three_files: Path
) -> None:
    """Before, the stage was retried for ever."""
    data = DataSpec(sources=[str(three_files)], filters=FilterSpec(min_words=1), chunk_mb=1)
    real = DataActivities(Settings(home=tmp_path / "home", data_roots=str(tmp_path)))

    async def main() -> BaseException:
        client = await Client.connect(temporal_address, data_converter=pydantic_data_converter)
        with ThreadPoolExecutor(2) as pool:
            async with (
                Worker(client, task_queue=task_queue, workflows=[DatasetSnapshotWorkflow]),
                Worker(client, task_queue=DATA_TASK_QUEUE, activity_executor=pool,
                       activities=[real.plan_dataset, _dies_on_a_record]),
            ):  # fmt: skip
                inp = DatasetInput(data=data, worker_heartbeat_timeout_s=2, max_attempts=2)
                handle = await client.start_workflow(
                    DatasetSnapshotWorkflow.run, inp, task_queue=task_queue,
                    id=f"dataset-test-{uuid.uuid4().hex[:8]}",
                )  # fmt: skip
                with pytest.raises(WorkflowFailureError) as failed:
                    await asyncio.wait_for(handle.result(), 60)
                return failed.value.cause

    cause = asyncio.run(main())
    message = str(cause)
    assert re.search(r"the scan stage of chunk \d failed 2 times", message), message
    assert "stopped answering" in message and "/corpus/poison.jsonl record 7" in message
