"""What travels through the HTTP API (`/v1`): requests, answers, and the one error shape.

Runs are answered with the workflows' own models (RunStatus, TrainProgress), so the API, the
CLI and the Temporal UI show the same fields under the same names.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from workflows.contracts.models import CodeRef, DatasetProgress, RunStatus, TrainProgress


class ErrorDetail(BaseModel):
    code: str = Field(description="a stable word for programs: unauthenticated, forbidden, …")
    message: str = Field(description="what is wrong, for a person")
    field: str | None = Field(None, description="the spec field or parameter at fault")
    fix: str | None = Field(None, description="what to do about it")


class ErrorBody(BaseModel):
    """Every error the API returns, whatever the status."""

    error: ErrorDetail


class WhoAmI(BaseModel):
    person: str
    roles: list[str]
    token_id: str


class SubmitRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    spec: dict[str, Any] = Field(
        description="the run spec, the keys of a spec file's TOML as JSON; `owner` is the "
        "caller (a different one is refused); data sources are absolute paths the data "
        "workers can read, s3:// URLs or store:KEY objects"
    )
    code: CodeRef | None = Field(
        None,
        description="the snapshot of the spec's train.code folder, as POST /v1/code answered "
        "it: required when the spec names train.code, refused when it does not",
    )


class RunView(BaseModel):
    status: RunStatus
    progress: TrainProgress | None = Field(
        None, description="the newest heartbeat of the current generation, while it trains"
    )
    execution: str | None = Field(None, description="Temporal's: RUNNING, COMPLETED, …")
    retrying: list[str] = Field([], description="activities failing and being retried")
    dataset: DatasetProgress | None = Field(
        None, description="the data stages' progress, while the run prepares its dataset"
    )

    @property
    def newest_step(self) -> int | None:
        """The gang's newest heartbeat's step; between gangs or once done, the last committed
        checkpoint's; None before either."""
        if self.progress is not None:
            return self.progress.step
        checkpoint = self.status.last_checkpoint
        return checkpoint.step if checkpoint is not None else None


class SubmitAnswer(BaseModel):
    created: bool = Field(description="true when this request started the run")
    run: RunView


class RunList(BaseModel):
    runs: list[RunView]


class MetricPoint(BaseModel):
    step: int
    value: float
    timestamp_ms: int = Field(description="when the rank logged it, milliseconds since the epoch")


class Metrics(BaseModel):
    run: str
    mlflow_run_id: str
    series: dict[str, list[MetricPoint]] = Field(description="each metric key, by step")


class LogPieceView(BaseModel):
    node_id: str
    file: str = Field(description='"rank-<R>" or "torchrun"')
    rank: int | None = Field(description="the rank whose output it is; none for torchrun's")
    offset: int = Field(description="where in its file this piece starts, in bytes")
    text: str


class RunLogs(BaseModel):
    run: str
    attempts: list[int] = Field(description="the generations (attempts) that left logs")
    attempt: int | None = Field(description="the one shown: the one asked for, or the latest")
    pieces: list[LogPieceView] = Field(description="in order: node, file, offset")
    more: bool = Field(description="the answer was cut at its size limit: ask again with `after`")


class LineageLink(BaseModel):
    what: str = Field(description="version, mlflow run, checkpoint, dataset, code, spec, …")
    detail: str
    check: str = Field("", description="'ok', what is wrong, or '' where nothing is checked")


class Lineage(BaseModel):
    """A version traced to its checkpoint, data and code, every hash checked against the
    store as it is now (as `forgeline lineage` prints it)."""

    links: list[LineageLink]
    broken: bool = Field(description="true when a hash does not match")


class ApproveRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    note: str = Field("", max_length=5000, description="recorded on the model version")
    override_gate: bool = Field(
        False, description="approve although the eval gate failed; the note must say why"
    )


class ResumeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    from_step: int | None = Field(
        None,
        ge=0,
        description="resume from the checkpoint kept at this step (any run that has ended, "
        "finished ones too); by default the last one (a FAILED or CANCELLED run)",
    )
    nodes: int | None = Field(
        None, ge=1, le=4096, description="run on this many nodes from now on (resources.nodes)"
    )


class RejectRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    reason: str = Field(min_length=1, max_length=5000, description="recorded on the version")


class NodeRow(BaseModel):
    node: str
    pod: str
    state: str = Field(description="idle, partial, allocated, spare, cordoned, draining, down")
    gpus: int
    gpus_used: int
    runs: list[str] = Field(description="the runs whose gangs hold GPUs here")
    reason: str | None = Field(None, description="why it is down or failing its health check")


class QueueRow(BaseModel):
    run: str
    team: str
    nodes: int
    gpus: int
    position: int | None = Field(None, description="in the last scheduling pass (0: next)")
    waited_s: float = Field(description="since it was queued (again, for a requeued run)")
    reason: str = Field(description="why it waits, as `forgeline jobs` says it")


class GangRow(BaseModel):
    run: str
    team: str
    nodes: list[str]
    gpus: int
    granted_at: datetime | None = None
    phase: str | None = Field(None, description="the run's, when its status answered")
    step: int | None = None
    total_steps: int | None = None
    goodput: float | None = Field(None, description="over its finished gang attempts so far")
    checkpoint_step: int | None = None
    checkpoint_age_s: float | None = Field(None, description="since its newest commit")
    yields_to: str | None = Field(None, description="lent reserved nodes: leaves for this run")


class RunRow(BaseModel):
    name: str
    phase: str
    owner: str
    team: str
    step: int | None = None
    total_steps: int
    tokens_per_s: float | None = None
    goodput: float | None = None
    temporal_url: str = Field(description="the run's workflow in the Temporal UI")
    mlflow_url: str | None = Field(None, description="its MLflow run, once it has one")


class FleetView(BaseModel):
    """What the cluster page (`GET /`) shows, made on the server from the same state as
    `forgeline nodes`, `jobs` and `runs`, so the page only draws it."""

    nodes: list[NodeRow]
    queue: list[QueueRow]
    gangs: list[GangRow]
    runs: list[RunRow]
    temporal_ui: str
    mlflow_ui: str
