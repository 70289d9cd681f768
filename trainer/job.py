"""The job file a node hands to its torchrun ranks: everything a rank needs, as plain JSON."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass
class ResumePoint:
    folder: str  # node-local copy of the checkpoint, already verified
    step: int
    tokens_seen: int
    manifest_key: str
    loss_history: list[list[float]] = field(default_factory=list)  # [step, loss] so far


@dataclass
class TrainJob:
    run_id: str
    node_id: str
    generation: int
    model: dict  # GPTConfig fields
    train: dict  # TrainSpec fields
    train_shards: list[str]
    dtype: str
    store_url: str
    staging_dir: str
    progress_file: str
    lineage: dict = field(default_factory=dict)  # dataset snapshot, spec hash: into every manifest
    stop_file: str = ""  # when it appears, the ranks checkpoint and exit (preemption, drain)
    resume: ResumePoint | None = None

    def write(self, path: Path) -> Path:
        path.write_text(json.dumps(asdict(self), indent=2))
        return path

    @classmethod
    def read(cls, path: Path) -> TrainJob:
        data = json.loads(path.read_text())
        resume = data.pop("resume")
        return cls(**data, resume=ResumePoint(**resume) if resume else None)
