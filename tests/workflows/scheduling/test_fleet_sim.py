"""The datacenter simulation (workflows/scheduling/fleet): reproducible, hand-checkable on small
fleets, policies ordered as they should be, and `forgeline simulate` end to end on a tiny config."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from workflows.contracts.cluster_models import QueueConfig
from workflows.scheduling.fleet.config import (
    BEFORE,
    POLICIES,
    Fleet,
    JobClass,
    PolicyName,
    Recovery,
    SimConfig,
)
from workflows.scheduling.fleet.engine import JobRecord, Simulation
from workflows.scheduling.fleet.progress import Attempt, SavePlan
from workflows.scheduling.fleet.report import compare, recovery_steps, report, run
from workflows.scheduling.fleet.workload import Job, Outage
from workflows.scheduling.policy_switches import TODAY

TEAMS = [QueueConfig(name="a", guaranteed_gpus=96), QueueConfig(name="b", guaranteed_gpus=96)]


def small(days: float = 3.0, **update: object) -> SimConfig:
    """32 nodes × 8 GPUs in pods of 8, contended: more work arrives than fits."""
    classes = [
        JobClass(name="1-8", jobs_per_day=60, gpus=[1, 2, 4, 8], hours_median=2, hours_max=12,
                 teams={"a": 1, "b": 1}),
        JobClass(name="16-64", jobs_per_day=12, gpus=[16, 32, 64], hours_median=6, hours_max=24,
                 save_s=40, restart_s=120, teams={"a": 1, "b": 1}),
        JobClass(name="128", jobs_per_day=0.7, gpus=[128], hours_median=12, hours_max=30,
                 priority=1, save_s=60, restart_s=300, teams={"a": 1}),
    ]  # fmt: skip
    base = SimConfig(
        days=days,
        warmup_days=0.5,
        users=12,
        fleet=Fleet(nodes=32, gpus_per_node=8, pod_size=8, spare_nodes=2),
        failures={"node_mtbf_h": 400.0, "repair_h": 4.0},
        classes=classes,
        queues=TEAMS,
    )
    return base.model_copy(update=update)


def test_attempt_arithmetic() -> None:
    a = Attempt(granted=0, restart=50, plan=SavePlan(1_000, store_stall=100), remaining=2_500)
    assert a.end == 50 + 2_500 + 3 * 100  # three saves: 1,000 + 1,000 + the last 500
    assert a.committed(1_149) == 0 and a.committed(1_150) == 1_000
    assert a.done(1_100) == 1_000 and a.done(1_200) == 1_050
    assert a.preempted(notice=1_200, grace=300) == (1_300, 1_050)  # saves what it has
    assert a.preempted(notice=1_200, grace=60) == (1_260, 1_000)  # no time to save


def test_one_failure_loses_exactly_the_work_since_the_last_checkpoint() -> None:
    _, record = _one_job(BEFORE, nodes=8, up_s=80_000)
    # Granted at the first tick (60 s), working from 110 s: one period (1,000 + 100 s save)
    # committed by 2,000 s; the 890 s since are lost. Asks again at 2,030 s, granted at the
    # 2,040 s tick on two other nodes, restarts and does the remaining 9,000 s in 9 periods.
    assert (record.failures, record.attempts, record.first_grant_s) == (1, 2, 60)
    assert record.finished_s == 2_040 + 50 + 9_000 + 9 * 100
    assert record.kept_s == 10_000
    assert record.allocated_gpu_s == 16 * ((2_000 - 60) + (record.finished_s - 2_040))


def test_peer_tier_and_asynchronous_saves_arithmetic() -> None:
    # Saves 1, 2 and 4 are peer copies (2 s stall, commit 5 s later), 3 and the final 5 go to
    # the store (10 s stall, commit 50 s later).
    plan = SavePlan(100, store_stall=10, store_lag=50, peer_stall=2, peer_lag=5, store_every=3)
    a = Attempt(granted=0, restart=20, plan=plan, remaining=450)
    assert a.end == 20 + 450 + 3 * 2 + 2 * 10 + 50
    assert a.committed(126) == 0 and a.committed(127) == 100
    assert a.committed(383) == 200 and a.committed(384) == 300  # the store save's upload
    assert a.committed(440) == 300 and a.committed(441) == 400
    assert a.committed(a.end - 1) == 400 and a.committed(a.end) == 450
    assert a.last_commit(230) == (229, 200)
    assert a.done(300) == 276 and a.done(330) == 300  # 330: in save 3's stall
    assert a.preempted(notice=300, grace=60) == (360, 276)  # a store save commits in time
    assert a.preempted(notice=300, grace=59) == (359, 200)
    half = Attempt(granted=0, restart=20, plan=plan, remaining=225, rate=0.5)  # a shrunk gang
    assert half.end == a.end and half.committed(441) == 200


def _one_job(recovery: Recovery, nodes: int, up_s: float) -> tuple[Simulation, JobRecord]:
    config = SimConfig(
        days=1,
        warmup_days=0,
        fleet=Fleet(nodes=nodes, gpus_per_node=8, pod_size=4, spare_nodes=0),
        classes=[
            JobClass(
                name="16", jobs_per_day=0, gpus=[16], hours_median=1, hours_max=9, teams={"a": 1}
            )
        ],
        queues=TEAMS,
        checkpoint_interval_s=1_000,
        tick_s=60,
        recovery=recovery,
    )
    job = Job("j", "16", "u", "a", 16, 10_000.0, 0.0, 0, save_s=100, restart_s=50)
    sim = Sized(config, [job], [Outage(node=0, down_s=2_000, up_s=up_s)])
    return sim, sim.run().records["j"]


def test_a_failure_under_the_stack_of_now() -> None:
    recovery = Recovery(detect_s=10, silent_fraction=0, warm_restart=0.5, async_stall=0.1,
                        store_every=4, peer_stall=0.5, peer_lag=0.1, min_nodes=1)  # fmt: skip
    _, record = _one_job(recovery, nodes=8, up_s=80_000)
    # Saves stall 10 s (store) or 5 s (peer), commit 90 s or 10 s later. Working from 110 s,
    # the first peer copy commits at 1,125 s; save 2 would stall until 2,120 s. The node dies
    # at 2,000 s, the survivors notice at 2,010 s and the run asks again at once (a first
    # failure: no backoff), is granted at the 2,040 s tick and restarts warm (25 s), then
    # trains the 9,000 s left: saves 4 and 8 and the last (9) to the store, six peer copies.
    assert (record.failures, record.attempts) == (1, 2)
    assert record.kept_s == 10_000
    assert record.finished_s == 2_040 + 25 + 9_000 + 3 * 10 + 6 * 5 + 90
    assert record.allocated_gpu_s == 16 * ((2_010 - 60) + (record.finished_s - 2_040))
    assert record.recovery_wait_s == 2_040 - 2_010


def test_an_elastic_gang_shrinks_when_nothing_replaces_its_node_and_grows_back() -> None:
    sim, record = _one_job(BEFORE.model_copy(update={"min_nodes": 0.5}), nodes=2, up_s=5_000)
    # Two nodes, no spare: the survivor goes on alone (half the work per second) until the
    # dead node is back at 5,000 s; then the gang stops at a checkpoint and gets both again.
    assert [size for _, size in sim.sizes] == [2, 1, 2]
    assert sim.sizes[2][0] >= 5_000
    assert (record.shrunk, record.regrown, record.preemptions) == (1, 1, 0)
    assert record.kept_s == 10_000 and record.finished_s is not None
    assert sim.out.preemptions == 0


def test_recovery_steps_go_from_before_to_the_model_one_gain_at_a_time() -> None:
    steps = recovery_steps(Recovery())
    assert steps[0] == ("before", BEFORE) and steps[-2][1] == Recovery()
    assert steps[-1][1] == Recovery(min_nodes=0.75)  # elastic, a run's choice: a what-if
    assert all(a != b for (_, a), (_, b) in itertools.pairwise(steps))  # each step changes
    custom = Recovery(detect_s=1, store_every=1, min_nodes=0.5)
    assert recovery_steps(custom)[-1][1] == custom


class Sized(Simulation):
    """Records when each gang was granted and on how many nodes."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.sizes: list[tuple[float, int]] = []

    def _granted(self, allocation, spares) -> None:  # type: ignore[no-untyped-def]
        self.sizes.append((self.now_s, len(allocation.nodes)))
        super()._granted(allocation, spares)


class Checked(Simulation):
    """Records every grant beside the job's size."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.grants: list[tuple[int, list[str]]] = []

    def _granted(self, allocation, spares) -> None:  # type: ignore[no-untyped-def]
        gpus = self.out.records[allocation.run_id].job.gpus
        self.grants.append((gpus, [n.node_id for n in allocation.nodes]))
        super()._granted(allocation, spares)


def test_gangs_whole_and_allocation_never_above_100_percent() -> None:
    from workflows.scheduling.fleet.workload import jobs, outages

    config = small(days=2)
    sim = Checked(config, jobs(config), outages(config))
    outcome = sim.run()
    assert sim.grants and outcome.failures_under_jobs > 0
    for gpus, nodes in sim.grants:
        assert len(set(nodes)) == len(nodes) == max(1, math.ceil(gpus / 8))
    figures = report(outcome)
    assert all(x <= 1 + 1e-9 for x in figures.hourly_allocation)
    assert figures.useful <= figures.allocation <= 1 + 1e-9
    assert all(0 <= c.goodput <= 1 for c in figures.classes)


def test_what_preemptions_cost_is_gpu_time_held_and_not_kept() -> None:
    """The cost of preemptions (thrown-away work, saves, restarts paid again) is a part of the
    GPU-time jobs held and did not keep, and each preemption that is granted again pays at
    least its restart."""
    from workflows.scheduling.fleet.workload import jobs, outages

    config = small(days=3)
    outcome = Simulation(config, jobs(config), outages(config)).run()
    cost = outcome.preemption_cost
    assert outcome.preemptions > outcome.yielded > 0
    assert cost.others > 0 and cost.yielders > 0
    records = outcome.records.values()
    held_not_kept = sum(r.allocated_gpu_s - r.job.gpus * r.kept_s for r in records)
    assert cost.others + cost.yielders <= held_not_kept
    cheapest_restart = min(r.job.gpus * r.job.restart_s for r in records) * (
        config.recovery.warm_restart
    )
    regranted = sum(r.preemptions - (r.restart_owed_by_yielder is not None) for r in records)
    assert cost.others + cost.yielders >= regranted * cheapest_restart


def test_same_seed_same_report_and_another_seed_differs() -> None:
    config = small(days=1.5)
    assert run(config) == run(config)
    assert run(config) != run(config.model_copy(update={"seed": 1}))


def test_policies_in_order_on_a_contended_fleet() -> None:
    reports = {r.policy: r for r in compare(small(days=3))}
    assert list(reports) == [p.value for p in PolicyName]
    assert reports["backfill"].allocation >= reports["fifo"].allocation
    assert reports["preemption"].allocation >= reports["backfill"].allocation
    assert reports["fifo"].preemptions == reports["backfill"].preemptions == 0
    assert reports["fifo"].spare_hits == reports["preemption"].spare_hits == 0
    yielding = {p.value for p in PolicyName if POLICIES[p].switches.yielding_backfill}
    assert yielding == {
        "spares",
        "spares-requeue-deadline",
        "spares-yield-latest",
        "spares-reserved-kept",
        "spares-patient-reclaim",
    }
    assert all(r.yielded == 0 for name, r in reports.items() if name not in yielding)
    assert all(r.yielded_cost == 0 for name, r in reports.items() if name not in yielding)
    assert reports["fifo"].preemption_cost == reports["backfill"].preemption_cost == 0
    assert reports["spares"].yielded_cost > 0 and reports["preemption"].preemption_cost > 0
    assert 0 < reports["spares"].yielded <= reports["spares"].preemptions


def test_the_default_policy_is_the_clusters() -> None:
    """What the simulator reports by default is what the Cluster workflow runs."""
    default = POLICIES[SimConfig().policy]
    assert default.switches == TODAY and default.borrowing and default.spares
    assert default.requeue_deadline


@pytest.fixture
def cli() -> typer.Typer:
    from worker.simulate_cli import simulate

    app = typer.Typer()
    app.command()(simulate)
    app.command("other")(lambda: None)  # two commands: typer keeps `simulate` a subcommand
    return app


TINY = """
days = 1
warmup_days = 0.25
users = 4
[fleet]
nodes = 8
pod_size = 4
spare_nodes = 1
[[queues]]
name = "a"
guaranteed_gpus = 64
[[classes]]
name = "small"
jobs_per_day = 40
gpus = [1, 8, 16]
hours_median = 1
hours_max = 4
teams = { a = 1 }
"""


def test_cli_report_and_compare(cli: typer.Typer, tmp_path: Path) -> None:
    path = tmp_path / "sim.toml"
    path.write_text(TINY)
    runner = CliRunner()
    done = runner.invoke(cli, ["simulate", "--config", str(path), "--out", str(tmp_path)])
    assert done.exit_code == 0, done.output
    assert "allocation" in done.output and "small" in done.output
    assert (tmp_path / "utilisation.png").stat().st_size > 0
    done = runner.invoke(
        cli, ["simulate", "--config", str(path), "--compare", "--seed", "3", "--out", str(tmp_path)]
    )
    assert done.exit_code == 0, done.output
    assert "fifo" in done.output and "spares" in done.output
    assert (tmp_path / "utilisation-compare.png").exists()
    done = runner.invoke(cli, ["simulate", "--config", str(path), "--recovery"])
    assert done.exit_code == 0, done.output
    assert "+ peer tier (the model)" in done.output and "elastic" in done.output
    done = runner.invoke(cli, ["simulate", "--config", str(path), "--hot-pool"])
    assert done.exit_code == 0, done.output
    assert "by bytes to fetch" in done.output and "copied ahead of demand" in done.output
    done = runner.invoke(cli, ["simulate", "--config", str(path), "--recovery", "--compare"])
    assert done.exit_code != 0 and "choose one" in str(done.exception)
    bad = tmp_path / "bad.toml"
    bad.write_text("dayz = 3\n")
    done = runner.invoke(cli, ["simulate", "--config", str(bad)])
    assert done.exit_code != 0 and "dayz" in str(done.exception)


def test_the_example_config_lists_the_defaults() -> None:
    import tomllib

    example = Path(__file__).resolve().parents[3] / "examples" / "simulate.toml"
    assert SimConfig.model_validate(tomllib.loads(example.read_text())) == SimConfig()
