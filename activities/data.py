"""Activities of the data workers: the stages of `dataprep.snapshot`, one chunk at a time.

Synchronous (they run in the worker's thread pool) and CPU-bound; each heartbeats the stage's
progress messages. The work itself is in activities.data_stages, loaded when a data worker is
made: it imports dataprep (DuckDB, pyarrow, datasketch), which only forgeline[data] installs,
and the processes' entry points import this class in every process, a GPU host's agent too.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType

from temporalio import activity

from activities.errors import domain_errors
from activities.heartbeat import keep_alive
from infra.extras import require_extra
from infra.settings import Settings
from workflows.contracts.models import DatasetInput, DatasetPlanRef, DatasetRef, DataStageInput


def load_stages() -> ModuleType:
    """activities.data_stages, or MissingExtra naming forgeline[data] on a host without it."""
    require_extra("data", "a data worker")
    return importlib.import_module("activities.data_stages")


class DataActivities:
    def __init__(self, settings: Settings, worker_name: str = "data") -> None:
        self.stages = load_stages()
        self.store = settings.open_store()
        self.workdir = settings.home / "data-work" / worker_name
        self.roots = self.stages.DataRoots.of(settings.data_root_folders())

    def _workdir(self, snapshot_id: str) -> Path:
        return self.workdir / snapshot_id

    @activity.defn(name="plan_dataset")
    def plan_dataset(self, inp: DatasetInput) -> DatasetPlanRef:
        with domain_errors(), keep_alive():
            return self.stages.plan_dataset(self.store, inp, self.roots)

    @activity.defn(name="scan_chunk")
    def scan_chunk(self, inp: DataStageInput) -> None:
        self._run("scan_chunk", inp)

    @activity.defn(name="dedup_dataset")
    def dedup_dataset(self, inp: DataStageInput) -> None:
        self._run("dedup_dataset", inp)

    @activity.defn(name="train_tokenizer")
    def train_tokenizer(self, inp: DataStageInput) -> None:
        self._run("train_tokenizer", inp)

    @activity.defn(name="tokenize_chunk")
    def tokenize_chunk(self, inp: DataStageInput) -> None:
        self._run("tokenize_chunk", inp)

    @activity.defn(name="commit_dataset")
    def commit_dataset(self, inp: DataStageInput) -> DatasetRef:
        with domain_errors(), keep_alive() as progress:
            workdir = self._workdir(inp.snapshot_id)
            return self.stages.commit(self.store, inp, workdir, progress)

    def _run(self, stage: str, inp: DataStageInput) -> None:
        with domain_errors(), keep_alive() as progress:
            workdir = self._workdir(inp.snapshot_id)
            self.stages.run_stage(self.store, stage, inp, workdir, progress)

    def all(self) -> list:
        return [
            self.plan_dataset,
            self.scan_chunk,
            self.dedup_dataset,
            self.train_tokenizer,
            self.tokenize_chunk,
            self.commit_dataset,
        ]
