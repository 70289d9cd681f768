"""The jobs and node failures of a simulation, drawn from one seed.

Arrivals per class are a Poisson process at the class's daily rate; a job's user (and so its
team) is drawn by the class's team weights; its size log-uniformly among the class's sizes; its
work lognormally, capped. Node failures are exponential with the node MTBF, repairs exponential
with the mean repair time. Each stream has its own generator derived from the seed, so adding a
class does not reshuffle the failures.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace

from workflows.scheduling.fleet.config import JobClass, SimConfig

DAY = 86_400.0


@dataclass(frozen=True)
class Job:
    run_id: str
    job_class: str
    user: str
    team: str
    gpus: int
    work_s: float  # compute seconds at full size, no failures or saves
    submit_s: float
    priority: int
    save_s: float
    restart_s: float
    base: int | None = None  # a fine-tune: the base model it starts from (an index)


@dataclass(frozen=True)
class Outage:
    node: int  # index into the fleet's nodes
    down_s: float
    up_s: float


def users(config: SimConfig) -> dict[str, list[str]]:
    """Team → its users: the users are split among the teams round-robin."""
    teams = sorted({t for c in config.classes for t in c.teams})
    split: dict[str, list[str]] = {t: [] for t in teams}
    for i in range(config.users):
        split[teams[i % len(teams)]].append(f"u{i:03d}")
    return split


def jobs(config: SimConfig) -> list[Job]:
    horizon = config.days * DAY
    by_team = users(config)
    drawn: list[Job] = []
    for index, job_class in enumerate(config.classes):
        rng = random.Random(f"{config.seed}/jobs/{index}")
        t = 0.0
        count = 0
        rate = job_class.jobs_per_day / DAY
        while rate > 0:
            t += rng.expovariate(rate)
            if t >= horizon:
                break
            drawn.append(_job(job_class, rng, by_team, t, count))
            count += 1
    return _with_bases(config, sorted(drawn, key=lambda j: (j.submit_s, j.run_id)))


def _with_bases(config: SimConfig, drawn: list[Job]) -> list[Job]:
    """Make `fine_tune_share` of the small jobs fine-tunes, of base models drawn by a Zipf law
    (a stream of its own: the other draws stay as they were)."""
    bases = config.base_models
    if bases.fine_tune_share == 0:
        return drawn
    rng = random.Random(f"{config.seed}/bases")
    weights = [1 / (k + 1) ** bases.popularity for k in range(bases.models)]
    models = range(bases.models)
    return [
        replace(job, base=rng.choices(models, weights)[0])
        if job.gpus <= bases.max_gpus and rng.random() < bases.fine_tune_share
        else job
        for job in drawn
    ]


def base_sizes_gb(config: SimConfig) -> list[float]:
    """Each base model's size, drawn once from the seed."""
    bases = config.base_models
    rng = random.Random(f"{config.seed}/base-sizes")
    return [rng.choices(bases.sizes_gb, bases.size_weights)[0] for _ in range(bases.models)]


def _job(
    job_class: JobClass, rng: random.Random, by_team: dict[str, list[str]], t: float, count: int
) -> Job:
    teams = sorted(job_class.teams)
    team = rng.choices(teams, weights=[job_class.teams[x] for x in teams])[0]
    user = rng.choice(by_team[team]) if by_team.get(team) else team
    hours = rng.lognormvariate(math.log(job_class.hours_median), job_class.hours_sigma)
    return Job(
        run_id=f"{job_class.name}-{count:05d}",
        job_class=job_class.name,
        user=user,
        team=team,
        gpus=rng.choice(job_class.gpus),
        work_s=min(hours, job_class.hours_max) * 3600,
        submit_s=t,
        priority=job_class.priority,
        save_s=job_class.save_s,
        restart_s=job_class.restart_s,
    )


def outages(config: SimConfig) -> list[Outage]:
    rng = random.Random(f"{config.seed}/failures")
    horizon = config.days * DAY
    mtbf_s = config.failures.node_mtbf_h * 3600
    repair_s = config.failures.repair_h * 3600
    found: list[Outage] = []
    for node in range(config.fleet.nodes):
        t = rng.expovariate(1 / mtbf_s)
        while t < horizon:
            up = t + (rng.expovariate(1 / repair_s) if repair_s > 0 else 0.0)
            found.append(Outage(node, t, up))
            t = up + rng.expovariate(1 / mtbf_s)
    return sorted(found, key=lambda o: (o.down_s, o.node))


def offered_gpu_s(config: SimConfig, drawn: list[Job]) -> float:
    """GPU-seconds of work submitted within the measured window (after warm-up)."""
    start = config.warmup_days * DAY
    return sum(j.gpus * j.work_s for j in drawn if j.submit_s >= start)
