"""What the replay test and the recorder share: where the recorded histories live, how they
are read and written, and a Replayer set up as the control worker runs its workflows."""

from __future__ import annotations

import gzip
from pathlib import Path

from temporalio.client import WorkflowHistory
from temporalio.worker import Replayer

from worker.temporal_client import DATA_CONVERTER
from workflows.cluster import ClusterWorkflow
from workflows.dataset import DatasetSnapshotWorkflow
from workflows.training_run import TrainingRun

HISTORIES = Path(__file__).resolve().parent / "histories"
# Every workflow the control worker registers (worker/processes_main.py), by its type name.
WORKFLOWS: dict[str, type] = {
    "TrainingRun": TrainingRun,
    "DatasetSnapshot": DatasetSnapshotWorkflow,
    "Cluster": ClusterWorkflow,
}
# Above this a recording is stored gzipped: the JSON of a history is mostly repeated field names.
GZIP_ABOVE = 300_000  # bytes


def history_files(folder: Path = HISTORIES) -> list[Path]:
    return sorted([*folder.glob("*.json"), *folder.glob("*.json.gz")])


def read_history(path: Path) -> WorkflowHistory:
    data = path.read_bytes()
    text = gzip.decompress(data) if path.name.endswith(".gz") else data
    # The workflow id only labels replay errors; the events carry everything replay uses.
    return WorkflowHistory.from_json(
        path.name.removesuffix(".gz").removesuffix(".json"), text.decode()
    )


def write_history(history: WorkflowHistory, stem: Path) -> Path:
    """`stem`.json, or `stem`.json.gz when the JSON is large; returns the file written."""
    text = history.to_json().encode()
    if len(text) <= GZIP_ABOVE:
        path = stem.with_name(f"{stem.name}.json")
        path.write_bytes(text)
    else:
        path = stem.with_name(f"{stem.name}.json.gz")
        # mtime=0: re-recording the same history writes the same bytes.
        path.write_bytes(gzip.compress(text, mtime=0))
    return path


def workflow_type(history: WorkflowHistory) -> str:
    return history.events[0].workflow_execution_started_event_attributes.workflow_type.name


def replayer() -> Replayer:
    """The control worker's setup: its workflows, its data converter (pydantic, with redacted
    failures), and the default sandbox (the worker passes no runner or restrictions)."""
    return Replayer(workflows=list(WORKFLOWS.values()), data_converter=DATA_CONVERTER)
