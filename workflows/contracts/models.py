"""Pydantic models that cross the wire between workflows, activities and the CLI.

New fields always get defaults, so histories recorded by an older version still replay.
Payloads carry keys into the object store, never data.
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum

from pydantic import BaseModel, Field

from workflows.contracts.cluster_models import Allocation
from workflows.contracts.spec import DataSpec, RunSpec


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
    EXPIRED = "EXPIRED"  # nobody decided within the approval window
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"

    @property
    def final(self) -> bool:
        return self in _FINAL_PHASES


_FINAL_PHASES = {Phase.APPROVED, Phase.REJECTED, Phase.EXPIRED, Phase.FAILED, Phase.CANCELLED}


# --- data, training, evaluation, registry ------------------------------------------------------


class DatasetInput(BaseModel):
    data: DataSpec
    requested_by: str = ""  # the run (or `forgeline data prepare`) that asked for it
    # A data worker that stops heartbeating this long is presumed dead (out of memory, say);
    # a stage's activity is tried this many times before the snapshot fails, naming what the
    # worker was reading when it was last heard from.
    worker_heartbeat_timeout_s: int = Field(120, ge=1)
    max_attempts: int = Field(5, ge=1)


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
    bytes: int = 0  # every shard and the tokenizer: what a node fetches (0: not known)


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


class CodeRef(BaseModel):
    """A user's code folder as a content-addressed snapshot in the store (infra.code_snapshot):
    nodes fetch it, check every file and the manifest's digest, and only then run it."""

    snapshot_id: str
    manifest_key: str
    manifest_sha256: str
    files: int
    bytes: int


class CheckpointRef(BaseModel):
    manifest_key: str
    step: int
    generation: int
    tokens_seen: int
    # Newer manifests passed over to find this one, and why (corrupt, torn, fenced out).
    skipped: list[str] = []
    # "peer": a peer-tier checkpoint (trainer.peer_tier): its files are on the gang's nodes,
    # and `fallback` is the store checkpoint to resume from if the new gang lacks some.
    tier: str = "store"
    fallback: CheckpointRef | None = None
    bytes: int = 0  # its files together, as its manifest lists them (0: not known)


class InitFromInput(BaseModel):
    source: str = Field(description="model.init_from as the spec has it")
    architecture: dict = Field(description="the run's network: GPTConfig fields and vocab_size")
    team: str = Field(
        "",
        description="the run's team: a registered version of another team's model must be "
        'approved to start from ("": a run from before runs said it, not checked)',
    )


class LatestCheckpointInput(BaseModel):
    run_id: str
    max_generation: int = Field(description="manifests from later generations are ignored")
    fence: bool = Field(
        False,
        description="max_generation is about to start from the checkpoint found: record it, "
        "so older generations can no longer commit one that counts (runs since the fence has "
        "its own activity, fence_generation, pass for_new_gang instead)",
    )
    for_new_gang: bool = Field(
        False,
        description="a new gang resumes from what is found: a newer peer-tier checkpoint wins, "
        "with the store's as its fallback",
    )
    run_uid: str = Field(
        "",
        description="the run's identity: claim runs/<run>/ for it (refused when another run "
        "of the name holds it) and read only its checkpoints; empty for runs from before",
    )
    at_most_step: int | None = Field(
        None, description="only checkpoints at this step or before (forgeline resume --from)"
    )

    @property
    def new_gang(self) -> bool:
        """A new gang resumes from what is found (fenced here, or by fence_generation)."""
        return self.fence or self.for_new_gang


class FenceInput(BaseModel):
    """Generation `generation` starts from `resume_step`: from now on an older generation's
    commits count only up to that step (trainer.manifest.record_generation)."""

    run_id: str
    generation: int
    resume_step: int
    run_uid: str = ""


class NodeTrainInput(BaseModel):
    run_id: str
    spec: RunSpec
    dataset: DatasetRef
    allocation: Allocation
    node_id: str
    resume: CheckpointRef | None = None
    init_from: CheckpointRef | None = None  # fine-tuning: weights to start from (no resume yet)
    mlflow_run_id: str | None = None  # where the head node streams the ranks' metrics
    code: CodeRef | None = None  # the user's training code; None: the built-in GPT trainer
    run_uid: str = ""  # into every manifest the ranks commit (trainer.run_identity)


class TrainProgress(BaseModel):
    """One heartbeat of the training activity: small on purpose (it is stored on every beat)."""

    node_id: str
    generation: int
    step: int = 0
    total_steps: int = 0
    loss: float | None = None
    lr: float | None = None
    tokens_per_s: float | None = None
    steps_per_s: float | None = None  # over the newest steps, saves included (an ETA's rate)
    mfu: float | None = None
    checkpoint_step: int | None = None
    state: str = "starting"
    epoch: int | None = None
    val_loss: float | None = None  # the latest in-training evaluation (train.eval_every)

    @property
    def eta_s(self) -> float | None:
        """Seconds until the last step at the newest rate (None: no rate yet)."""
        if not self.steps_per_s or not self.total_steps:
            return None
        return max(0, self.total_steps - self.step) / self.steps_per_s


class HealthEvent(BaseModel):
    """Something wrong with a node that did not (yet) fail the gang: a straggler, a suspect of
    silent corruption. Carries its generation: older generations' events are ignored."""

    generation: int
    node_id: str | None
    kind: str  # straggler | corruption
    step: int | None = None
    evidence: str = ""
    action: str = "report"  # report: recorded and shown; swap: the node is cordoned and replaced
    at: datetime | None = None


class NodeTrainResult(BaseModel):
    node_id: str
    generation: int
    final_step: int
    final_loss: float | None
    tokens_per_s: float | None = None
    mfu: float | None = None
    stopped: bool = False  # asked to stop early: checkpointed at final_step and exited
    finished: bool = False  # the ranks said they are done (all of a script's ranks returned)
    stop_reason: str | None = None  # "asked to stop" (preemption, drain) or "preempted" (SIGTERM)
    health: list[HealthEvent] = []  # what the gang's health checks found in this attempt
    # A peer-tier checkpoint its ranks passed over for the store's, and why (trainer.peer_restore)
    skipped: list[str] = []


class LedgerMark(BaseModel):
    """Rank 0's running totals at the end of one step (trainer.attempt_clock), seconds."""

    step: int
    at: float  # wall clock, seconds since the epoch
    steps: int = 0  # steps this attempt trained up to here
    train_s: float
    stall_s: float
    eval_s: float
    straggler_s: float
    shadow_s: float = 0.0  # part of train_s: shadow checks (0 in ledgers from before them)
    bubble_s: float = 0.0  # part of train_s: a pipeline's bubble (0 without one, or before)


class AttemptLedger(BaseModel):
    """What the ranks of one generation recorded about their own time (epoch seconds)."""

    resume_step: int
    ready_at: float | None  # ranks up, checkpoint loaded: training starts
    load_s: float = 0.0
    spawned_at: float | None = None  # rank 0's process started (before its imports)
    init_at: float | None = None  # rank 0 called forgeline.init() (imports done)
    kept: LedgerMark | None = None  # at the step of this attempt's checkpoint the run kept
    last: LedgerMark | None = None  # at the last step the ledger heard of
    ended: str | None = None


class AttemptLedgerInput(BaseModel):
    run_id: str
    generation: int
    # The step of the checkpoint the run kept from this attempt, when the workflow knows it (the
    # final or stop commit); otherwise the newest commit of the generation that is not fenced.
    kept_step: int | None = None
    # The newest commit at or before `kept_step` rather than that step's: a later gang resumed
    # from an older checkpoint than this attempt's newest (its peer copy was skipped).
    kept_at_most: bool = False


class AttemptCause(StrEnum):
    """Why a gang attempt was asked for: what came before it."""

    START = "start"  # the run's first gang
    FAILURE = "failure"  # the gang before failed (a dead, hung or corrupting node)
    PREEMPTION = "preemption"  # the gang before was preempted, and the run queued again
    SWAP = "swap"  # a straggler was swapped out of the gang before
    GROW = "grow"  # an elastic gang that had shrunk grows back


class AttemptOutcome(StrEnum):
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    PREEMPTED = "preempted"
    SWAPPED = "swapped"  # ended to swap a straggler out
    REGROWN = "regrown"  # an elastic gang stopped to grow back to its full size


class AttemptRecord(BaseModel):
    """One gang attempt, as the workflow saw it and as its ranks recorded it."""

    generation: int
    gpus: int
    requested_at: datetime
    granted_at: datetime
    ended_at: datetime | None = None
    outcome: AttemptOutcome = AttemptOutcome.RUNNING
    after: AttemptCause = AttemptCause.START
    ledger: AttemptLedger | None = None


class NodeStopInput(BaseModel):
    run_id: str
    generation: int


class EvaluateInput(BaseModel):
    run_id: str
    spec: RunSpec
    dataset: DatasetRef
    checkpoint: CheckpointRef


class EvalPoint(BaseModel):
    step: int
    val_loss: float


class Sample(BaseModel):
    prompt: str
    text: str


class EvalSource(StrEnum):
    """Who measured a run's eval loss: Forgeline from the final checkpoint (the built-in
    trainer's), or the run's own script (`run.report_eval`), which the gate cannot check."""

    PLATFORM = "platform"
    SCRIPT = "script"


# How every place that shows a script's eval loss (the gate, status, reports) says so.
SELF_REPORTED = "self-reported by the run's script"


class EvalResult(BaseModel):
    step: int
    # None (with measured_on "nothing"): a script as it is (train.checkpoints = "folder")
    # reported no loss at all; the version is registered without one, and no gate passes it.
    val_loss: float | None
    perplexity: float | None
    val_tokens: int
    sample: str  # the first prompt's continuation
    samples: list[Sample] = []  # every prompt's (registry.sample_prompt, then sample_prompts)
    curve: list[EvalPoint] = []  # held-out loss of every committed checkpoint kept, by step
    curve_left_out: list[str] = []  # older checkpoints that did not verify, and why
    # "held-out": the validation split; "train": a user's script reported no held-out loss, and
    # this is its last training loss (trainer.reported_eval); "nothing": it reported no loss.
    measured_on: str = "held-out"
    # Who measured it (None: an evaluation from before this was recorded).
    source: EvalSource | None = None

    @property
    def self_reported(self) -> bool:
        """The run's own script reported this loss: nothing Forgeline measured backs it.
        Before `source` was recorded, only a script's evaluation could be a training loss."""
        if self.source is None:
            return self.measured_on == "train"
        return self.source == EvalSource.SCRIPT


class Goodput(BaseModel):
    """Where the run's GPU-seconds went, from its own history (workflows.goodput)."""

    gpu_s: float  # the run's GPUs × its time from the first gang request to the end of training
    allocated_gpu_s: float  # of which it held a gang
    productive_gpu_s: float  # training steps that ended in a checkpoint the run kept
    lost_gpu_s: dict[str, float]  # cause -> GPU-seconds; with productive, adds up to gpu_s
    attempts: int

    @property
    def goodput(self) -> float:
        return self.productive_gpu_s / self.gpu_s if self.gpu_s else 0.0

    @property
    def allocated_goodput(self) -> float:
        return self.productive_gpu_s / self.allocated_gpu_s if self.allocated_gpu_s else 0.0


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
    goodput: Goodput | None = None
    health: list[HealthEvent] = []
    mlflow_run_id: str | None = None  # the run opened at the start; None: registration opens one
    code: CodeRef | None = None  # the user's code snapshot that trained it (lineage)


class TrackingInput(BaseModel):
    run_id: str
    workflow_run_id: str
    spec: RunSpec
    spec_sha256: str


class CloseTrackingInput(BaseModel):
    """A training run that ended without a model: its MLflow run ends with it."""

    mlflow_run_id: str
    status: str  # MLflow's: FAILED or KILLED
    error: str = ""


class ModelVersionRef(BaseModel):
    model_name: str
    version: str
    mlflow_run_id: str
    alias: str = "candidate"


# A decision's reason travels in a Temporal update and becomes an MLflow tag: a sentence or a
# paragraph, far below either's limits.
MAX_REASON_CHARS = 5000


class Decision(BaseModel):
    approver: str
    approve: bool
    reason: str = ""
    override_gate: bool = False  # approve although the eval gate failed; needs a reason
    # The HTTP API's word that the person its token names took this decision on this version
    # (workflows/contracts/decision_signature.py); a run counts no decision without it.
    signed_at: datetime | None = None
    signature: str = ""  # HMAC-SHA256, hex, under the store's decision key


class DecisionCheckInput(BaseModel):
    """A decision the run received, for the control worker to check the API's signature."""

    run_id: str
    version: ModelVersionRef
    decision: Decision
    received_at: datetime  # the workflow's time when the update reached it


class DecisionCheck(BaseModel):
    refused: str | None = None  # why the signature does not hold; None: the API vouched for it


class ApprovalPolicyInput(BaseModel):
    model_name: str
    team: str


class ApprovalPolicy(BaseModel):
    """Who may decide on one run's model, and the bar it must clear: the operators' approvals
    file (registry.approvals) merged with the run's own, stricter, settings."""

    approvers: list[str] = []  # empty: anyone but the submitter (unless self-approval is on)
    allow_self_approval: bool = False
    max_val_loss: float | None = None  # the eval gate; None: no gate
    source: str = ""  # where the rules came from, for the person who is refused


class DecisionInput(BaseModel):
    version: ModelVersionRef
    decision: Decision
    decided_at: datetime
    tags: dict[str, str] = {}  # what the gate said, recorded beside the decision
    expired: bool = False  # nobody decided in time: record that, move no alias


# --- the run as a whole ----------------------------------------------------------------------


class TrainingRunInput(BaseModel):
    spec: RunSpec
    spec_sha256: str
    submitted_by: str = "anonymous"
    code: CodeRef | None = None  # uploaded by the submitter before the run starts (train.code)
    carried: RunCarry | None = None  # set by the run itself when it continues as new
    # Made at submission, kept by `forgeline resume`: what the run's checkpoints belong to
    # (trainer.run_identity). Empty for runs submitted before identities existed.
    run_uid: str = ""
    # `forgeline resume --from STEP`: the execution's first gang starts from the checkpoint at
    # this step, and its fence makes the older generations' later commits stale, so the later
    # gangs continue this new lineage. Never carried across continue-as-new.
    resume_from_step: int | None = None


class Failure(BaseModel):
    generation: int
    node_id: str | None  # the node at fault, if one is known
    reason: str
    at: datetime
    kind: str = "fail-stop"  # fail-stop: the node died or hung; unhealthy: its own check failed


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
    team: str = ""  # the queue whose quota it uses ("": a run started before this was shown)
    model_name: str = ""  # the registered model its versions go to
    dataset_workflow_id: str | None = None
    attempts: int = 0
    generation: int | None = None
    nodes: list[str] = []
    # Elastic: the gang holds fewer than `resources.nodes` after a failure (None: all of them).
    shrunk_from: int | None = None
    dataset: DatasetRef | None = None
    last_checkpoint: CheckpointRef | None = None
    init_from: CheckpointRef | None = None  # the weights fine-tuning started from
    evaluation: EvalResult | None = None
    mlflow_run_id: str | None = None  # the MLflow run that tracks this run from its start
    model_version: ModelVersionRef | None = None
    decision: Decision | None = None
    approval: ApprovalPolicy | None = None  # the rules the decision is checked against
    approval_deadline: datetime | None = None  # the run ends EXPIRED if nobody decides by then
    # What the run keeps of its past is bounded (workflows.run_records): the newest entries of
    # each list, the totals beside them, so a long run with a flapping node stays far under
    # Temporal's payload and history limits.
    failures: list[Failure] = []  # the newest 20
    failures_total: int = 0  # every failure, listed or not (0: a run from before the count)
    preemptions: list[PreemptionRecord] = []  # the newest 20
    preemptions_total: int = 0
    swaps: int = 0  # straggler swaps so far (recovery.max_swaps bounds them)
    # Nodes its ranks reported (a straggler swapped out, silent corruption): its later gangs go
    # elsewhere (GangRequest.avoid); the cluster cordons one only on more teams' word.
    suspect_nodes: list[str] = []  # the newest 64
    health: list[HealthEvent] = []  # the newest 20 of the current and past generations
    skipped_checkpoints: list[str] = []  # checkpoints resume passed over, and why (newest 20)
    refused_grants: list[str] = []  # grants signalled to the run that were not the cluster's
    # Decisions whose signature did not hold (sent to Temporal past the API), and why: newest 20.
    refused_decisions: list[str] = []
    gang_attempts: list[AttemptRecord] = []  # the newest 30
    earlier_goodput: Goodput | None = None  # the attempts no longer listed, accounted
    earlier_ended_at: datetime | None = None  # when the last of those ended
    continued: int = 0  # times the workflow continued as new (a fresh history, same run)
    goodput: Goodput | None = None
    final_loss: float | None = None
    tokens_per_s: float | None = None
    mfu: float | None = None
    error: str | None = None
    updated_at: datetime | None = None


class RunCarry(BaseModel):
    """What a TrainingRun hands on when it continues as new between gang attempts: its
    status and the little state the next attempt needs. Preparation, the MLflow run and the
    fine-tuning weights are done; they are in the status."""

    status: RunStatus
    submitted_at: datetime  # the run's age in the queue survives the new history
    newest_generation: int = 0
    newest_confirmed: int = 0
    after: AttemptCause = AttemptCause.START  # what the next attempt follows


TrainingRunInput.model_rebuild()
