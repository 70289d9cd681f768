"""The figures of a simulation: fleet utilisation, and per size class goodput and waits.

Fleet figures are measured after the warm-up (an empty cluster filling up is not the steady
state): allocation % = allocated GPU-time / healthy GPU-time; useful % = GPU-time of work kept
(steps whose checkpoint committed, or still running at the end) / healthy GPU-time. Per class:
goodput = useful / allocated GPU-time of its jobs (all of them: failures do not care about
warm-up); queue waits (submission to first grant, jobs submitted after the warm-up; a job still
waiting at the end counts with what it has waited so far); starvation = waits past the limit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from workflows.scheduling.fleet.base_models import FetchFigures
from workflows.scheduling.fleet.config import (
    BEFORE,
    COMPARED_HOT_FRACTION,
    COMPARED_SHARE,
    PolicyName,
    Recovery,
    SimConfig,
)
from workflows.scheduling.fleet.engine import JobRecord, Outcome, simulate
from workflows.scheduling.fleet.progress import IntervalRule
from workflows.scheduling.fleet.workload import DAY, jobs, outages


@dataclass(frozen=True)
class ClassFigures:
    name: str
    jobs: int
    finished: int
    gpu_hours_share: float  # of the work submitted
    goodput: float
    wait_p50_h: float
    wait_p99_h: float
    starved: int
    preemptions: int
    failures: int
    recovery_wait_h: float  # mean, per recovery: failure noticed → the new gang
    # The longest wait of a run queued again after it ran (a failure, a preemption; one still
    # waiting at the end with what it has waited so far): starvation after a start.
    requeued_wait_max_h: float
    shrunk: int  # attempts on fewer nodes than asked (elastic)


@dataclass(frozen=True)
class BigRun:
    run_id: str
    submitted_h: float
    waited_h: float
    progress: float  # of its work, kept
    goodput: float
    # The run's own view (its goodput ledger): the full gang's GPU-time while it waited to
    # recover counts as lost too.
    goodput_with_waits: float
    attempts: int
    failures: int
    recovery_wait_h: float  # in all


@dataclass(frozen=True)
class Report:
    policy: str
    recovery: Recovery
    days: float
    gpus: int
    offered: float  # work submitted after warm-up / healthy GPU-time
    allocation: float
    useful: float
    preemptions: int
    yielded: int  # of the preemptions, yielders leaving as agreed (workflows.scheduling.yielding)
    # What the preemptions cost (engine.PreemptionCost), as shares of all healthy GPU-time of
    # the simulation: the others', and the yielders' leaving as agreed.
    preemption_cost: float
    yielded_cost: float
    failures_under_jobs: int
    recoveries: int
    spare_hits: int
    passes: int
    max_queue: int
    still_waiting: int
    classes: list[ClassFigures]
    big_runs: list[BigRun]
    # Healthy GPU-time left free by each pass, by why (workflows.scheduling.fleet.idle.CAUSES).
    idle: dict[str, float]
    hourly_allocation: list[float] = field(repr=False)
    hourly_useful: list[float] = field(repr=False)
    fetches: FetchFigures | None = None  # with fine-tunes in the workload


def percentile(values: list[float], q: float) -> float:
    """Nearest rank: deterministic, and exact on small hand-checked samples."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else 0.0


def report(outcome: Outcome) -> Report:
    config = outcome.config
    trace = outcome.trace
    start_s = config.warmup_days * DAY
    end_s = config.days * DAY
    first = int(start_s // trace.bin_s)
    healthy = sum(trace.healthy[first:])
    records = list(outcome.records.values())
    offered = sum(r.job.gpus * r.job.work_s for r in records if r.job.submit_s >= start_s)
    classes = [
        _class(job_class.name, [r for r in records if r.job.job_class == job_class.name],
               start_s, end_s, config.starvation_h, offered)
        for job_class in config.classes
    ]  # fmt: skip
    biggest = max((c.gpus[-1] for c in config.classes), default=0)
    big = [r for r in records if r.job.gpus >= biggest and biggest >= 1_024]
    return Report(
        policy=config.policy.value,
        recovery=config.recovery,
        days=config.days,
        gpus=config.gpus,
        offered=_ratio(offered, healthy),
        allocation=_ratio(sum(trace.allocated[first:]), healthy),
        useful=_ratio(sum(trace.useful[first:]), healthy),
        idle={cause: _ratio(gpu_s, healthy) for cause, gpu_s in outcome.idle.gpu_s.items()},
        preemptions=outcome.preemptions,
        yielded=outcome.yielded,
        preemption_cost=_ratio(outcome.preemption_cost.others, sum(trace.healthy)),
        yielded_cost=_ratio(outcome.preemption_cost.yielders, sum(trace.healthy)),
        failures_under_jobs=outcome.failures_under_jobs,
        recoveries=outcome.recoveries,
        spare_hits=outcome.spare_hits,
        passes=outcome.passes,
        max_queue=outcome.max_queue,
        still_waiting=len(outcome.still_waiting),
        classes=classes,
        big_runs=[_big(r, end_s) for r in big],
        hourly_allocation=list(map(_ratio, trace.allocated, trace.healthy)),
        hourly_useful=list(map(_ratio, trace.useful, trace.healthy)),
        fetches=FetchFigures.of(outcome.fetches, percentile) if outcome.fetches else None,
    )


def _wait_s(record: JobRecord, end_s: float) -> float:
    granted = record.first_grant_s if record.first_grant_s is not None else end_s
    return granted - record.job.submit_s


def _requeued_wait_s(record: JobRecord, end_s: float) -> float:
    waiting = end_s - record.requeued_s if record.requeued_s is not None else 0.0
    return max(record.longest_requeued_wait_s, waiting)


def _class(
    name: str,
    records: list[JobRecord],
    start_s: float,
    end_s: float,
    starvation_h: float,
    offered: float,
) -> ClassFigures:
    measured = [r for r in records if r.job.submit_s >= start_s]
    waits_h = [_wait_s(r, end_s) / 3600 for r in measured]
    work = sum(r.job.gpus * r.job.work_s for r in measured)
    useful = sum(r.job.gpus * r.kept_s for r in records)
    return ClassFigures(
        name=name,
        jobs=len(records),
        finished=sum(1 for r in records if r.finished_s is not None),
        gpu_hours_share=_ratio(work, offered),
        goodput=_ratio(useful, sum(r.allocated_gpu_s for r in records)),
        wait_p50_h=percentile(waits_h, 50),
        wait_p99_h=percentile(waits_h, 99),
        starved=sum(1 for w in waits_h if w > starvation_h),
        preemptions=sum(r.preemptions for r in records),
        failures=sum(r.failures for r in records),
        recovery_wait_h=_ratio(sum(r.recovery_wait_s for r in records) / 3600,
                               sum(r.failures for r in records)),
        requeued_wait_max_h=max((_requeued_wait_s(r, end_s) for r in records), default=0.0) / 3600,
        shrunk=sum(r.shrunk for r in records),
    )  # fmt: skip


def _big(record: JobRecord, end_s: float) -> BigRun:
    return BigRun(
        run_id=record.job.run_id,
        submitted_h=record.job.submit_s / 3600,
        waited_h=_wait_s(record, end_s) / 3600,
        progress=_ratio(record.kept_s, record.job.work_s),
        goodput=_ratio(record.job.gpus * record.kept_s, record.allocated_gpu_s),
        goodput_with_waits=_ratio(
            record.job.gpus * record.kept_s,
            record.allocated_gpu_s + record.job.gpus * record.recovery_wait_s,
        ),
        attempts=record.attempts,
        failures=record.failures,
        recovery_wait_h=record.recovery_wait_s / 3600,
    )


def run(config: SimConfig, interval: IntervalRule | None = None) -> Report:
    """Draw the workload and failures from the config's seed, simulate, report."""
    return report(simulate(config, jobs(config), outages(config), interval))


def hot_pool_steps(config: SimConfig) -> list[SimConfig]:
    """The same fine-tune workload three ways (`--hot-pool`): placement blind to base models
    (as before it counted bytes to fetch), placement by bytes to fetch, and with the hot pool."""
    bases = config.base_models
    share = bases.fine_tune_share or COMPARED_SHARE
    on = bases.hot_fraction or COMPARED_HOT_FRACTION
    steps = [(False, 0.0), (True, 0.0), (True, on)]
    return [
        config.model_copy(
            update={"base_models": bases.model_copy(update={
                "fine_tune_share": share, "place_by_bytes": by_bytes, "hot_fraction": fraction,
            })}
        )
        for by_bytes, fraction in steps
    ]  # fmt: skip


def compare(config: SimConfig, interval: IntervalRule | None = None) -> list[Report]:
    """Every policy on the same seed, so the same jobs and the same failures."""
    return [run(config.model_copy(update={"policy": name}), interval) for name in PolicyName]


# What the stack gained, one step at a time: each step takes these fields of the recovery model
# being simulated on top of the step before, starting from the model before.
RECOVERY_STEPS: list[tuple[str, tuple[str, ...]]] = [
    ("before", ()),
    ("+ asynchronous store saves", ("async_stall",)),
    ("+ detection by the survivors", ("detect_s", "silent_fraction", "heartbeat_timeout_s",
                                      "first_backoff")),
    ("+ warm restarts", ("warm_restart",)),
    ("+ peer tier", ("store_every", "peer_stall", "peer_lag")),
]  # fmt: skip
# Elastic gangs are a run's choice (`[resources] min_nodes`), off in the default model; the
# comparison shows what they would change at this share when the model does not set one.
ELASTIC_SHARE = 0.75


def recovery_steps(recovery: Recovery) -> list[tuple[str, Recovery]]:
    """The models from `BEFORE` to `recovery`, adding one of the stack's gains at a time, and
    then elastic gangs (at `recovery.min_nodes`, or at `ELASTIC_SHARE` if it never shrinks)."""
    steps: list[tuple[str, Recovery]] = []
    taken: dict[str, object] = {}
    for name, fields in RECOVERY_STEPS:
        taken |= {f: getattr(recovery, f) for f in fields}
        steps.append((name, BEFORE.model_copy(update=taken)))
    share = recovery.min_nodes if recovery.min_nodes < 1 else ELASTIC_SHARE
    steps.append((f"+ elastic: min_nodes {share:.0%} of nodes", recovery.model_copy(
        update={"min_nodes": share})))  # fmt: skip
    return steps
