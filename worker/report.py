"""`forgeline report RUN`: a run's loss, throughput and goodput as PNG plots, with a short
Markdown summary next to them, written to a folder and logged to the run's MLflow run.

`build_report` is pure apart from the files it writes: it takes the workflow's status and the
MLflow metric histories as they are, so a report of a run that is still training, or of one
whose metrics never reached MLflow, is the same code with less to draw. What is missing is said
in the summary, never raised.

This module fetches, builds and logs; `report_plots` draws the figures, `report_summary` writes
the Markdown, and `report_data` holds what they share.
"""

from __future__ import annotations

import os
from datetime import UTC, datetime
from pathlib import Path

from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from infra.errors import StoreError
from infra.extras import require_extra
from infra.settings import Settings
from infra.store.protocol import ObjectStore
from trainer.manifest import counted
from worker.report_data import (
    CheckpointMark,
    Metrics,
    Report,
    by_time,
    first_line,
    mlflow_run_of,
)
from worker.report_summary import summary
from workflows.contracts.models import RunStatus

ARTIFACT_PATH = "report"


# --- fetching ------------------------------------------------------------------------------------


def fetch_metrics(tracking_uri: str, run_id: str) -> Metrics:
    """Every metric of the MLflow run with its whole history, in the order it was logged."""
    client = MlflowClient(tracking_uri=tracking_uri)
    metrics: Metrics = {}
    for key in client.get_run(run_id).data.metrics:
        history = client.get_metric_history(run_id, key)
        # Timestamp first: a restarted generation logs steps again, later; keep both in order.
        metrics[key] = sorted(((m.step, m.value, m.timestamp) for m in history), key=by_time)
    return metrics


def fetch_checkpoints(store: ObjectStore, run_id: str) -> list[CheckpointMark]:
    """The checkpoints still in the store (pruning keeps the newest few), oldest first."""
    marks = []
    for kept in reversed(counted(store, run_id)):
        committed = kept.manifest.committed_at
        if committed:
            marks.append(CheckpointMark(kept.step, kept.generation, _parse(committed)))
    return marks


def _parse(text: str) -> datetime:
    at = datetime.fromisoformat(text)
    return at if at.tzinfo else at.replace(tzinfo=UTC)


def log_report(tracking_uri: str, run_id: str, report: Report) -> str:
    """The files the report wrote, and nothing else of `--out`'s folder (which may be a home)."""
    client = MlflowClient(tracking_uri=tracking_uri)
    for path in report.files:
        client.log_artifact(run_id, str(path), artifact_path=ARTIFACT_PATH)
    return f"MLflow run {run_id}, artifacts {ARTIFACT_PATH}/"


def report_run(settings: Settings, status: RunStatus, out_dir: Path) -> Report:
    """What `forgeline report` does once it has the status: fetch, draw, write, log."""
    require_extra("plots", "forgeline report")  # before fetching anything it could not draw
    # A report must not hang for minutes on MLflow's default retries when the server is down:
    # it says what it could not read instead.
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "20")
    run_id = mlflow_run_of(status)
    notes, metrics = [], {}
    if run_id is None:
        notes.append("no MLflow run is recorded for this run: no metric curves, nothing logged")
    else:
        try:
            metrics = fetch_metrics(settings.mlflow_uri, run_id)
        except (MlflowException, OSError) as err:
            notes.append(
                f"MLflow run {run_id} at {settings.mlflow_uri} unreadable: {first_line(err)}"
            )
            run_id = None  # nor can the report go there
    checkpoints = []
    try:
        checkpoints = fetch_checkpoints(settings.open_store(), status.name)
    except (StoreError, OSError, ValueError, KeyError) as err:
        notes.append(f"checkpoint manifests in {settings.store} unreadable: {first_line(err)}")
    report = build_report(status, metrics, out_dir, checkpoints=checkpoints, notes=notes)
    if run_id is not None:
        try:
            report.logged_to = log_report(settings.mlflow_uri, run_id, report)
        except (MlflowException, OSError) as err:
            report.missing.append(f"not logged to MLflow run {run_id}: {first_line(err)}")
    return report


# --- building ------------------------------------------------------------------------------------


def build_report(
    status: RunStatus,
    metrics: Metrics,
    out_dir: Path,
    *,
    checkpoints: list[CheckpointMark] | None = None,
    notes: list[str] | None = None,
) -> Report:
    """Write loss.png, throughput.png, goodput.png and report.md into `out_dir`."""
    # Imported here: the figures need matplotlib (forgeline[plots]); without it `forgeline
    # report` says which extra to install instead of failing at its import.
    from worker.report_plots import goodput_figure, loss_figure, save_png, throughput_figure

    out_dir.mkdir(parents=True, exist_ok=True)
    report = Report(out_dir, missing=list(notes or []))
    missing = report.missing  # each figure adds what it had nothing to draw for
    report.files.append(save_png(loss_figure(status, metrics, missing), out_dir / "loss.png"))
    report.files.append(
        save_png(throughput_figure(status, metrics, missing), out_dir / "throughput.png")
    )
    report.files.append(
        save_png(goodput_figure(status, checkpoints or [], missing), out_dir / "goodput.png")
    )
    report.markdown.write_text(summary(status, metrics, report))
    report.files.append(report.markdown)
    return report
