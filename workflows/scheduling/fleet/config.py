"""What a simulation declares: the fleet, its failures, the teams, the job mix and the policy.

The defaults are the issue's datacenter: 2,500 nodes × 8 GPUs in pods of 32, 300 users,
~1,200 jobs a day (most ≤ 8 GPUs, ~60 % of GPU-hours in 64–1,024-GPU gangs, a few 4,096-GPU
runs), three weeks. `examples/simulate.toml` lists every key.
"""

from __future__ import annotations

from dataclasses import fields, replace
from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field, model_validator

from workflows.contracts.cluster_models import ClusterConfig, QueueConfig
from workflows.scheduling.policy_switches import Switches


class PolicyName(StrEnum):
    """The policies `--compare` sets side by side, each adding to the one before."""

    FIFO = "fifo"  # strict arrival order, no backfill, no borrowing, no preemption, no spares
    BACKFILL = "backfill"  # priority + fair share order, EASY backfill
    PREEMPTION = "preemption"  # + borrowing beyond guarantees, reclaimed by preemption
    UNGUARDED = "spares-unguarded"  # + a spare pool for failed gangs: the default until the guard
    GUARDED = "spares-guarded"  # + the starvation guard and start deadline (..scheduler)
    SPARES = "spares"  # + yielding backfill on reserved nodes (workflows.scheduling.yielding)
    # + a start deadline for requeued runs too, counted from the requeue (held_reservations)
    REQUEUE_DEADLINE = "spares-requeue-deadline"
    # + a yielder goes to the reservation that starts latest (..yielding.latest_first)
    YIELD_LATEST = "spares-yield-latest"
    # + the spare pool never refills from nodes a reservation holds (scheduler.choose_spares)
    RESERVED_NOT_SPARE = "spares-reserved-kept"
    # + a reclaim waits `reclaim_after_s` after its submission (preemption.reclaims_now)
    PATIENT_RECLAIM = "spares-patient-reclaim"


class Policy(BaseModel):
    """A policy the simulator runs: the scheduler's switches, and what the simulator decides
    beside them (the cluster's config, how a requeued run asks again)."""

    switches: Switches
    borrowing: bool  # False: every team is capped at its guarantee
    spares: bool  # the fleet keeps `spare_nodes` for failed gangs
    # A run requeued after it ran gets a start deadline counted from its requeue
    # (workflows.scheduling.held_reservations).
    requeue_deadline: bool = False


def _first(*, borrowing: bool, spares: bool, **switches: bool) -> Policy:
    """One of the policies from before the guard: only the named switches on."""
    off = {f.name: False for f in fields(Switches)}
    return Policy(switches=Switches(**(off | switches)), borrowing=borrowing, spares=spares)


POLICIES: dict[PolicyName, Policy] = {
    PolicyName.FIFO: _first(borrowing=False, spares=False, arrival_order=True),
    PolicyName.BACKFILL: _first(borrowing=False, spares=False, backfill=True),
    PolicyName.PREEMPTION: _first(borrowing=True, spares=False, backfill=True, preemption=True),
    PolicyName.UNGUARDED: _first(borrowing=True, spares=True, backfill=True, preemption=True),
    PolicyName.GUARDED: _first(
        borrowing=True,
        spares=True,
        backfill=True,
        preemption=True,
        starvation_guard=True,
        start_deadline=True,
    ),
}


def _each_adding(base: Policy, switches: list[tuple[PolicyName, str]]) -> dict[PolicyName, Policy]:
    """From the guard on, each policy is the one before it with one more switch on (the
    scheduler's, or the simulator's `requeue_deadline`)."""
    policies: dict[PolicyName, Policy] = {}
    for name, switch in switches:
        if switch in Policy.model_fields:
            base = base.model_copy(update={switch: True})
        else:
            base = base.model_copy(update={"switches": replace(base.switches, **{switch: True})})
        policies[name] = base
    return policies


POLICIES |= _each_adding(
    POLICIES[PolicyName.GUARDED],
    [
        (PolicyName.SPARES, "yielding_backfill"),
        (PolicyName.REQUEUE_DEADLINE, "requeue_deadline"),
        (PolicyName.YIELD_LATEST, "yield_latest_first"),
        (PolicyName.RESERVED_NOT_SPARE, "spares_off_reservations"),
        (PolicyName.PATIENT_RECLAIM, "reclaim_patience"),
    ],
)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Fleet(_Strict):
    nodes: int = Field(2_500, ge=1)
    gpus_per_node: int = Field(8, ge=1)
    pod_size: int = Field(32, ge=1, description="nodes per pod (one network island)")
    spare_nodes: int = Field(16, ge=0, description="held back for failed gangs (policy spares)")
    preemption_grace_s: int = Field(300, ge=1)
    aging_s: float = Field(3_600.0, gt=0)
    reclaim_after_s: float = Field(900.0, ge=0, description="policy spares-patient-reclaim")
    fair_share_half_life_h: float = Field(24.0, gt=0)


class Failures(_Strict):
    # Llama 3 (Dubey et al., 2024): 419 unexpected interruptions in 54 days on 16,384 GPUs,
    # about one per 6,300 node-hours.
    node_mtbf_h: float = Field(6_000.0, gt=0, description="0 < MTBF; per node")
    repair_h: float = Field(8.0, ge=0, description="mean time a failed node stays down")
    recovery_backoff_s: float = Field(
        30.0, ge=0, description="a failure in a row noticed → the run asks again"
    )


class Recovery(_Strict):
    """How runs save and recover: what the stack does now. The ratios were measured here on the
    local stack (README, Benchmarks); the rest are stated assumptions. `BEFORE` is the model
    the simulator used until then: a node failure noticed at once and followed by the backoff,
    every save blocking for its whole duration, every restart cold, no peer tier."""

    # bench/recovery, 2026-12-04: a rank's crash is reported by its agent within 0.2 s and the
    # dead node misses its 2 s liveness probe: 2.2-2.5 s from SIGKILL to the run recovering
    # (3.3-3.9 s on 2026-12-03, before the survivors' crash reports).
    detect_s: float = Field(2.3, ge=0, description="a node's death noticed, by its survivors")
    # Assumed: failures no survivor sees (a frozen host, a partition) wait for the heartbeat
    # timeout (the spec's default, 15 s).
    silent_fraction: float = Field(0.1, ge=0, le=1, description="of failures: noticed late")
    heartbeat_timeout_s: float = Field(15.0, ge=0)
    first_backoff: bool = Field(False, description="back off before the first retry too")
    # bench/recovery, 2026-12-04, two runs: a warm standby's restart took 1.7 and 1.1 s where a
    # cold torchrun took 4.1 and 3.9 s (forked ranks, static rendezvous); 4.4 / 5.9 s = 0.75 on
    # 2026-12-03.
    warm_restart: float = Field(0.35, gt=0, le=1, description="a recovery's restart ÷ a cold one")
    # bench/trainer: a save of 63 M parameters + AdamW stalled the loop 0.013 s, 1/69 of a
    # synchronous dcp.save (0.868 s); the rest of the save runs behind the training.
    async_stall: float = Field(1 / 69, gt=0, le=1, description="a save's stall ÷ its duration")
    store_every: int = Field(10, ge=1, description="one save in n to the store; 1: no peer tier")
    # bench/recovery: peer saves every 10 steps added 1.1 GPU-s of stall over about 54 of them
    # (10 ms a rank), where a store save stalled 17 ms a rank: about 0.6.
    peer_stall: float = Field(0.6, gt=0, description="a peer save's stall ÷ a store save's")
    # Assumed: a node sends its own shards to one peer over its own NICs, where a store save
    # puts every node's through the shared storage: a tenth of the store save's duration.
    peer_lag: float = Field(0.1, ge=0, description="a peer copy's commit ÷ a store save")
    # Elastic runs (`[resources] min_nodes`, a run's choice, so off by default): after a
    # failure with no spare and no free node a gang of more than one node goes on with as few
    # as this share of its nodes, and grows back when they are free.
    min_nodes: float = Field(1.0, gt=0, le=1, description="share of nodes; 1: never shrink")


BEFORE = Recovery(
    detect_s=0.0,
    silent_fraction=0.0,
    first_backoff=True,
    warm_restart=1.0,
    async_stall=1.0,
    store_every=1,
)


class JobClass(_Strict):
    """A size class of the workload: how often it arrives, how big and long, how it saves."""

    name: str
    jobs_per_day: float = Field(ge=0)
    gpus: list[int] = Field(min_length=1, description="sizes, drawn log-uniformly among these")
    hours_median: float = Field(gt=0, description="work (compute) hours; lognormal")
    hours_sigma: float = Field(1.0, ge=0)
    hours_max: float = Field(gt=0)
    priority: int = 0
    save_s: float = Field(30.0, ge=0, description="a checkpoint's blocking save")
    restart_s: float = Field(120.0, ge=0, description="startup/restart: spawn, rendezvous, load")
    teams: dict[str, float] = Field(min_length=1, description="team → weight")


def _classes() -> list[JobClass]:
    research = {"llm": 3.0, "multimodal": 2.0, "rl": 1.0, "pretrain": 1.0}
    everyone = research | {"ranking": 3.0, "search": 2.0, "ads": 1.5, "speech": 1.0}
    return [
        JobClass(
            name="1-8",
            jobs_per_day=870,
            gpus=[1, 2, 4, 8],
            hours_median=4.4,
            hours_sigma=1.2,
            hours_max=48,
            save_s=10,
            restart_s=60,
            teams=everyone,
        ),
        JobClass(
            name="16-32",
            jobs_per_day=280,
            gpus=[16, 32],
            hours_median=8.5,
            hours_sigma=1.0,
            hours_max=72,
            save_s=20,
            restart_s=120,
            teams=everyone,
        ),
        JobClass(
            name="64-1024",
            jobs_per_day=63,
            gpus=[64, 128, 256, 512, 1024],
            hours_median=7.5,
            hours_sigma=0.8,
            hours_max=96,
            save_s=40,
            restart_s=300,
            teams=research | {"ranking": 2.0, "search": 1.0},
        ),
        JobClass(
            name="4096",
            jobs_per_day=0.3,
            gpus=[4_096],
            hours_median=72.0,
            hours_sigma=0.3,
            hours_max=150,
            priority=1,
            save_s=60,
            restart_s=600,
            teams={"pretrain": 1.0},
        ),
    ]


def _queues() -> list[QueueConfig]:
    q = QueueConfig
    return [
        q(name="research", guaranteed_gpus=13_000),
        q(name="pretrain", parent="research", guaranteed_gpus=6_000),
        q(name="llm", parent="research", guaranteed_gpus=3_400, max_gpus=10_000),
        q(name="multimodal", parent="research", guaranteed_gpus=2_400, max_gpus=8_000),
        q(name="rl", parent="research", guaranteed_gpus=1_200, max_gpus=4_000),
        q(name="product", guaranteed_gpus=6_600),
        q(name="ranking", parent="product", guaranteed_gpus=3_000, max_gpus=8_000),
        q(name="search", parent="product", guaranteed_gpus=1_800, max_gpus=6_000),
        q(name="ads", parent="product", guaranteed_gpus=1_000, max_gpus=3_000),
        q(name="speech", parent="product", guaranteed_gpus=800, max_gpus=3_000),
    ]


class BaseModels(_Strict):
    """Fine-tunes from base models in the store, and the hot pool that keeps those models on
    nodes (`workflows.scheduling.hot_pool`). No fine-tunes by default: the workload of every
    other report stays as it was; `forgeline simulate --hot-pool` compares the pool off and on
    with `COMPARED_SHARE` of the small jobs fine-tunes if this says none."""

    fine_tune_share: float = Field(
        0.0, ge=0, le=1, description="of the jobs of up to max_gpus GPUs: fine-tunes"
    )
    max_gpus: int = Field(32, ge=1, description="fine-tunes are jobs of at most this many GPUs")
    models: int = Field(24, ge=1, le=1000, description="distinct base models")
    popularity: float = Field(1.1, gt=0, description="Zipf exponent: model k is used ∝ 1/k^s")
    # Assumed: weights in bf16 for 8 B and 70 B parameter models, seven small ones in ten.
    sizes_gb: list[float] = Field([16.0, 140.0], min_length=1)
    size_weights: list[float] = Field([0.7, 0.3], min_length=1)
    # Assumed: a node's share of the store's bandwidth, 10 Gbit/s.
    fetch_gb_per_s: float = Field(1.25, gt=0)
    node_cache_gb: float = Field(1_000.0, gt=0, description="of base models, per node")
    hot_fraction: float = Field(0.0, ge=0, le=1, description="the pool's share of nodes; 0: off")
    hot_models: int = Field(4, ge=1, le=16)
    # False: requests do not say what they read, as before placement counted bytes to fetch
    # (a fine-tune then lands wherever packing puts it).
    place_by_bytes: bool = True

    @model_validator(mode="after")
    def _weights_match(self) -> BaseModels:
        if len(self.size_weights) != len(self.sizes_gb):
            raise ValueError("base_models: size_weights needs one weight per sizes_gb entry")
        return self


COMPARED_SHARE = 0.5  # of the small jobs, when `--hot-pool` compares and the config has none
COMPARED_HOT_FRACTION = 0.25  # the pool's share of nodes, when the config has none


class SimConfig(_Strict):
    days: float = Field(21.0, gt=0)
    warmup_days: float = Field(2.0, ge=0, description="not measured: the cluster fills up")
    seed: int = 0
    users: int = Field(300, ge=1)
    # The Cluster workflow passes every 60 s; 300 s keeps three weeks at 20,000 GPUs in ~2 min
    # here (a pass sweeps every node), at the cost of up to 5 min of extra wait per grant.
    tick_s: float = Field(300.0, gt=0, description="at most one scheduling pass per tick")
    runtime_estimate: float = Field(1.5, ge=1.0, description="declared max runtime ÷ expected")
    starvation_h: float = Field(24.0, gt=0, description="a wait longer than this is starvation")
    policy: PolicyName = PolicyName.PATIENT_RECLAIM
    fleet: Fleet = Fleet()
    failures: Failures = Failures()
    recovery: Recovery = Recovery()
    base_models: BaseModels = BaseModels()
    checkpoint_interval_s: float = Field(
        1_800.0, gt=0, description="used when no interval rule (Young/Daly) is passed in"
    )
    classes: list[JobClass] = Field(default_factory=_classes)
    queues: list[QueueConfig] = Field(default_factory=_queues)

    @model_validator(mode="after")
    def _sound(self) -> SimConfig:
        if self.warmup_days >= self.days:
            raise ValueError(f"warmup_days ({self.warmup_days}) must be below days ({self.days})")
        known = {q.name for q in self.queues}
        for job_class in self.classes:
            unknown = sorted(set(job_class.teams) - known)
            if unknown:
                raise ValueError(f"class {job_class.name}: teams {unknown} are not in queues")
        ClusterConfig(queues=self.queues)  # the tree's own checks
        return self

    def cluster_config(self, policy: Policy) -> ClusterConfig:
        """The scheduler's configuration under `policy`: no borrowing caps every team at its
        guarantee; no spares keeps no node back."""
        queues = self.queues
        if not policy.borrowing:
            queues = [q.model_copy(update={"max_gpus": q.guaranteed_gpus}) for q in queues]
        fleet = self.fleet
        return ClusterConfig(
            pods=[f"pod{i:03d}" for i in range(self.pods)],
            queues=queues,
            spare_nodes=fleet.spare_nodes if policy.spares else 0,
            preemption_grace_s=fleet.preemption_grace_s,
            aging_s=fleet.aging_s,
            fair_share_half_life_h=fleet.fair_share_half_life_h,
            reclaim_after_s=fleet.reclaim_after_s,
            hot_fraction=self.base_models.hot_fraction,
            hot_models=self.base_models.hot_models,
        )

    @property
    def pods(self) -> int:
        return -(-self.fleet.nodes // self.fleet.pod_size)

    @property
    def gpus(self) -> int:
        return self.fleet.nodes * self.fleet.gpus_per_node
