"""What a run report is made of, shared by its parts: the MLflow metric series and their keys,
the checkpoint marks from the store, the `Report` being written, and the helpers that more than
one part needs. Kept apart so `report_plots` and `report_summary` can use them without importing
`report`, which imports them both.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from workflows.contracts.models import RunStatus

Point = tuple[int, float, int]  # step, value, timestamp in ms: one MLflow metric value
Metrics = dict[str, list[Point]]

# Streamed by the head rank while it trains (every generation, so steps can repeat).
LOSS, LR, TOKENS_PER_S, MFU, VAL_LOSS = (
    "train/loss",
    "train/lr",
    "train/tokens_per_s",
    "train/mfu",
    "train/val_loss",
)
# Logged at registration: the loss history of the checkpoint lineage the model came from.
KEPT_LOSS = "train_loss"


@dataclass(frozen=True)
class CheckpointMark:
    """A committed checkpoint, as its manifest in the store records it."""

    step: int
    generation: int
    at: datetime


@dataclass
class Report:
    out_dir: Path
    files: list[Path] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)  # what the report could not show, and why
    logged_to: str | None = None  # where in MLflow the folder went

    @property
    def markdown(self) -> Path:
        return self.out_dir / "report.md"


def mlflow_run_of(status: RunStatus) -> str | None:
    """The MLflow run that tracks the run; runs older than that field only have their model's."""
    if status.mlflow_run_id:
        return status.mlflow_run_id
    return status.model_version.mlflow_run_id if status.model_version else None


def by_time(point: Point) -> tuple[int, int]:
    """Sort key of a metric value: when it was logged, then its step."""
    return point[2], point[0]


def first_line(err: object) -> str:
    """An error or reason as one short line of the summary."""
    text = str(err).strip()
    return text.splitlines()[0][:300] if text else type(err).__name__
