"""What a soak will do, drawn from a seed before it starts, and what it saw: typed, so the JSON
file a soak writes can be read back by a test and replayed (`SoakRecord.load`).

The faults arrive as a Poisson process (exponential gaps with the given mean); each draws its
kind from the mix and a `pick`, a number the injector uses to choose its target among what is
running at that moment (a node of a gang, a rank, a run), so the same seed makes the same
choices whenever the same things are running.
"""

from __future__ import annotations

import json
import random
from enum import StrEnum
from pathlib import Path

from pydantic import BaseModel, Field


class FaultKind(StrEnum):
    KILL_AGENT = "kill-agent"  # SIGKILL a node agent under a gang (torchrun and ranks follow)
    STOP_RANK = "stop-rank"  # SIGSTOP one rank for a while, then SIGCONT (a straggler or a hang)
    SCALE_GRAD = "scale-grad"  # a rank's gradients scaled at a shadow-checked step
    FAIL_HEALTH = "fail-health"  # a node's own health check fails, then passes again
    KILL_CONTROL = "kill-control"  # SIGKILL the control worker (workflows, evaluation, registry)
    RESTART_TEMPORAL = "restart-temporal"  # the Temporal server stopped and started (an upgrade)
    MLFLOW_DOWN = "mlflow-down"  # MLflow stopped for `outage_s`
    PREEMPT = "preempt"  # the guaranteed team submits a run that reclaims borrowed nodes
    DRAIN = "drain"  # an operator drains a node under a gang, then puts it back


# The control plane's faults: they touch no gang, so their recovery is the stack answering again.
CONTROL_PLANE = {FaultKind.KILL_CONTROL, FaultKind.RESTART_TEMPORAL, FaultKind.MLFLOW_DOWN}


class Fault(BaseModel):
    at_s: float = Field(description="seconds after the soak's start")
    kind: FaultKind
    pick: int = Field(description="chooses the target among what is running then")
    hold_s: float = Field(0.0, description="how long the fault lasts before it is mended")


class RunKind(StrEnum):
    DDP = "ddp"  # the built-in GPT, two nodes, data parallel
    FSDP = "fsdp"  # the same sharded (examples/tiny-fsdp.toml)
    SHADOW = "shadow"  # DDP with every 10th step shadow-checked: the only target of scale-grad


class PlannedRun(BaseModel):
    name: str
    team: str
    kind: RunKind
    preemptible: bool


class SoakPlan(BaseModel):
    seed: int
    duration_s: float
    mean_interval_s: float
    outage_s: float = Field(description="how long MLflow stays down, a node stays unhealthy")
    steps: int
    checkpoint_every: int
    nodes: int
    faults: list[Fault]


class SoakEvent(BaseModel):
    """One thing the soak did or saw, at seconds after its start."""

    at_s: float
    what: str  # a fault's kind, "mend", "submit", "ended", "violation", "stack"
    target: str = ""  # a node, a run, a server
    detail: str = ""
    run: str = ""  # the run whose gang a fault hit, and its generation then
    generation: int = 0
    hold_s: float = 0.0  # how long the fault was to last
    free_nodes: int | None = None  # nodes free for a gang when a fault fired (a spare to move to)


class Interruption(BaseModel):
    """A gang that ended early (failed, preempted, swapped out), and what it cost its run."""

    outcome: str  # AttemptOutcome: failed, preempted, swapped
    lost_steps: int  # trained again by the next gang that trained
    restart_s: float  # its last step to the next gang's first, less any wait for nodes to free


class RecoveryPhases(BaseModel):
    """Where one node death's recovery went, in seconds (bench/recovery_phases.py)."""

    detect: float  # the fault to the workflow's end of the gang it hit
    regrant: float  # that end to the next gang's grant
    launch: float  # the grant to the script's start on the new gang
    restore: float  # the script's start to its checkpoint restored
    first_step: float  # restored to the first step

    @property
    def total(self) -> float:
        return self.detect + self.regrant + self.launch + self.restore + self.first_step


class RunFigures(BaseModel):
    """One run of a soak, from its own records (bench/soak_report.py)."""

    phase: str
    error: str = ""
    restarts: dict[str, int] = {}  # by what the new gang followed: failure, preemption, swap
    interruptions: list[Interruption] = []
    half_interval: float
    lost_commits: list[str] = []  # must stay empty
    step_s: float = 0.0  # median
    gpus: int = 0
    gpu_s: float = 0.0  # as reported
    lost_gpu_s: dict[str, float] = {}  # as reported, by cause
    goodput_reported: float | None = None
    goodput_measured: float | None = None
    # The failure model's own terms, measured: the kept steps' work, the saves' stalls, the
    # steps trained again and the restarts, in seconds of the run's gangs (`scope_s`); the
    # model (infra.capacity_plan.goodput) predicts the share of work in them.
    scope_s: float = 0.0
    goodput_scope_measured: float | None = None
    goodput_predicted: float | None = None
    bitwise: bool | None = None  # final weights against the fault-free reference of its kind

    @property
    def lost_steps(self) -> list[int]:
        return [i.lost_steps for i in self.interruptions]


class ProbeAnswers(BaseModel):
    """The liveness probes of every run (bench/probe_answers.py)."""

    answered_ms: list[float] = []  # scheduled to completed, each probe an agent answered
    unanswered: int = 0  # timed out: a dead agent, or a live one too slow (a node lost)


class SoakReport(BaseModel):
    runs: dict[str, RunFigures] = {}
    not_ended: list[str] = []
    violations: list[str] = []  # nodes or runs booked twice
    waited_free: list[str] = []  # gangs that waited over 10 s with enough nodes free
    recovery_s: dict[str, list[float]] = {}  # fault kind -> seconds to the victim's next step
    # The node losses' recoveries by part, keyed as recovery_s (a node free, or none).
    recovery_phases: dict[str, list[RecoveryPhases]] = {}
    faults: dict[str, int] = {}  # fired, by kind
    passed_over: int = 0  # faults that found nothing to hit
    probes: ProbeAnswers | None = None


class SoakRecord(BaseModel):
    plan: SoakPlan
    started_epoch: float = 0.0  # time.time() at the soak's start: events' at_s count from it
    runs: list[PlannedRun] = []
    events: list[SoakEvent] = []
    report: SoakReport | None = None

    def save(self, path: Path) -> None:
        path.write_text(self.model_dump_json(indent=1) + "\n")

    @classmethod
    def load(cls, path: Path) -> SoakRecord:
        return cls.model_validate(json.loads(path.read_text()))


# Each kind's share of the faults: node faults most, as a fleet sees them; the control plane's
# now and then.
DEFAULT_MIX: dict[FaultKind, float] = {
    FaultKind.KILL_AGENT: 3,
    FaultKind.STOP_RANK: 2,
    FaultKind.SCALE_GRAD: 1,
    FaultKind.FAIL_HEALTH: 1,
    FaultKind.KILL_CONTROL: 1,
    FaultKind.RESTART_TEMPORAL: 1,
    FaultKind.MLFLOW_DOWN: 1,
    FaultKind.PREEMPT: 1,
    FaultKind.DRAIN: 1,
}


def draw_faults(
    seed: int,
    duration_s: float,
    mean_interval_s: float,
    outage_s: float,
    mix: dict[FaultKind, float] | None = None,
) -> list[Fault]:
    """The faults of a soak of `duration_s`, one every `mean_interval_s` on average."""
    chance = random.Random(seed)
    weights = mix or DEFAULT_MIX
    kinds, shares = list(weights), list(weights.values())
    faults: list[Fault] = []
    at = chance.expovariate(1 / mean_interval_s)
    while at < duration_s:
        kind = chance.choices(kinds, shares)[0]
        # A stopped rank is held from a blip to past a hang's detection; the others last the
        # outage the plan gives them.
        hold = chance.uniform(2, 3 * outage_s) if kind == FaultKind.STOP_RANK else outage_s
        pick = chance.randrange(1 << 30)
        faults.append(Fault(at_s=round(at, 2), kind=kind, pick=pick, hold_s=round(hold, 2)))
        at += chance.expovariate(1 / mean_interval_s)
    return faults
