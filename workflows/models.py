"""Pydantic models that cross the wire between workflows, activities and the CLI.

New fields always get defaults, so histories recorded by an older version still replay.
Payloads carry keys into the object store, never data.
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum

from pydantic import BaseModel, Field

from workflows.cluster_models import Allocation
from workflows.spec import DataSpec, RunSpec


class Phase(StrEnum):
    PREPARING = "PREPARING"
    QUEUED = "QUEUED"
    TRAINING = "TRAINING"
    RECOVERING = "RECOVERING"
    EVALUATING = "EVALUATING"
    REGISTERING = "REGISTERING"
    AWAITING_APPROVAL = "AWAITING_APPROVAL"
    APPROVED = "APPROVED"
    REJECTED = "REJECTED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"

    @property
    def final(self) -> bool:
        return self in _FINAL_PHASES


_FINAL_PHASES = {Phase.APPROVED, Phase.REJECTED, Phase.FAILED, Phase.CANCELLED}


# --- data, training, evaluation, registry ------------------------------------------------------


class DatasetInput(BaseModel):
    data: DataSpec
    requested_by: str = ""  # the run (or `forgeline data prepare`) that asked for it


class DataStageInput(BaseModel):
    """One data-preparation activity; the plan itself stays in the store (it can be large)."""

    snapshot_id: str
    data: DataSpec
    chunk: int | None = None


class DatasetRef(BaseModel):
    snapshot_id: str
    manifest_key: str
    manifest_sha256: str
    vocab_size: int
    train_tokens: int
    val_tokens: int
    documents: int
    duplicates_removed: int
    filtered: int = 0
    reused: bool = False


class DatasetPlanRef(BaseModel):
    snapshot_id: str
    chunks: int
    existing: DatasetRef | None = None


class StageProgress(BaseModel):
    name: str
    done: int = 0
    total: int = 0


class DatasetProgress(BaseModel):
    snapshot_id: str | None = None
    stages: list[StageProgress] = []


class CheckpointRef(BaseModel):
    manifest_key: str
    step: int
    generation: int
    tokens_seen: int


class InitFromInput(BaseModel):
    source: str = Field(description="model.init_from as the spec has it")
    architecture: dict = Field(description="the run's network: GPTConfig fields and vocab_size")


class LatestCheckpointInput(BaseModel):
    run_id: str
    max_generation: int = Field(description="manifests from later generations are ignored")
    fence: bool = Field(
        False,
        description="max_generation is about to start from the checkpoint found: record it, "
        "so older generations can no longer commit one that counts",
    )


class NodeTrainInput(BaseModel):
    run_id: str
    spec: RunSpec
    dataset: DatasetRef
    allocation: Allocation
    node_id: str
    resume: CheckpointRef | None = None
    init_from: CheckpointRef | None = None  # fine-tuning: weights to start from (no resume yet)


class TrainProgress(BaseModel):
    """One heartbeat of the training activity: small on purpose (it is stored on every beat)."""

    node_id: str
    generation: int
    step: int = 0
    total_steps: int = 0
    loss: float | None = None
    lr: float | None = None
    tokens_per_s: float | None = None
    mfu: float | None = None
    checkpoint_step: int | None = None
    state: str = "starting"
    epoch: int | None = None
    val_loss: float | None = None  # the latest in-training evaluation (train.eval_every)


class NodeTrainResult(BaseModel):
    node_id: str
    generation: int
    final_step: int
    final_loss: float | None
    tokens_per_s: float | None = None
    mfu: float | None = None
    stopped: bool = False  # asked to stop early: checkpointed at final_step and exited
    stop_reason: str | None = None  # "asked to stop" (preemption, drain) or "preempted" (SIGTERM)


class NodeStopInput(BaseModel):
    run_id: str
    generation: int


class EvaluateInput(BaseModel):
    run_id: str
    spec: RunSpec
    dataset: DatasetRef
    checkpoint: CheckpointRef


class EvalResult(BaseModel):
    step: int
    val_loss: float
    perplexity: float
    val_tokens: int
    sample: str


class RegisterInput(BaseModel):
    run_id: str
    workflow_run_id: str
    spec: RunSpec
    spec_sha256: str
    dataset: DatasetRef
    checkpoint: CheckpointRef
    evaluation: EvalResult
    training: list[NodeTrainResult] = []
    attempts: int = 0


class ModelVersionRef(BaseModel):
    model_name: str
    version: str
    mlflow_run_id: str
    alias: str = "candidate"


class Decision(BaseModel):
    approver: str
    approve: bool
    reason: str = ""


class DecisionInput(BaseModel):
    version: ModelVersionRef
    decision: Decision
    decided_at: datetime


# --- the run as a whole ----------------------------------------------------------------------


class TrainingRunInput(BaseModel):
    spec: RunSpec
    spec_sha256: str
    submitted_by: str = "anonymous"


class Failure(BaseModel):
    generation: int
    node_id: str | None
    reason: str
    at: datetime


class PreemptionRecord(BaseModel):
    generation: int
    reason: str
    at: datetime
    step: int | None = None  # where it checkpointed before giving the nodes back


class RunStatus(BaseModel):
    name: str
    phase: Phase
    owner: str
    total_steps: int
    spec_sha256: str = ""
    dataset_workflow_id: str | None = None
    attempts: int = 0
    generation: int | None = None
    nodes: list[str] = []
    dataset: DatasetRef | None = None
    last_checkpoint: CheckpointRef | None = None
    init_from: CheckpointRef | None = None  # the weights fine-tuning started from
    evaluation: EvalResult | None = None
    model_version: ModelVersionRef | None = None
    decision: Decision | None = None
    failures: list[Failure] = []
    preemptions: list[PreemptionRecord] = []
    final_loss: float | None = None
    tokens_per_s: float | None = None
    mfu: float | None = None
    error: str | None = None
    updated_at: datetime | None = None
