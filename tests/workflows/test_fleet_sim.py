"""The datacenter simulation (workflows/fleet): reproducible, hand-checkable on small fleets,
policies ordered as they should be, and `forgeline simulate` end to end on a tiny config."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from workflows.cluster_models import QueueConfig
from workflows.fleet.config import Fleet, JobClass, PolicyName, SimConfig
from workflows.fleet.engine import Simulation
from workflows.fleet.progress import Attempt
from workflows.fleet.report import compare, report, run
from workflows.fleet.workload import Job, Outage

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
    a = Attempt(granted=0, restart=50, interval=1_000, save=100, remaining=2_500)
    assert a.end == 50 + 2_500 + 3 * 100  # three saves: 1,000 + 1,000 + the last 500
    assert a.committed(1_149) == 0 and a.committed(1_150) == 1_000
    assert a.done(1_100) == 1_000 and a.done(1_200) == 1_050
    assert a.preempted(notice=1_200, grace=300) == (1_300, 1_050)  # saves what it has
    assert a.preempted(notice=1_200, grace=60) == (1_260, 1_000)  # no time to save


def test_one_failure_loses_exactly_the_work_since_the_last_checkpoint() -> None:
    config = SimConfig(
        days=1,
        warmup_days=0,
        fleet=Fleet(nodes=8, gpus_per_node=8, pod_size=4, spare_nodes=0),
        classes=[
            JobClass(
                name="16", jobs_per_day=0, gpus=[16], hours_median=1, hours_max=9, teams={"a": 1}
            )
        ],
        queues=TEAMS,
        checkpoint_interval_s=1_000,
        tick_s=60,
    )
    job = Job("j", "16", "u", "a", 16, 10_000.0, 0.0, 0, save_s=100, restart_s=50)
    out = Simulation(config, [job], [Outage(node=0, down_s=2_000, up_s=80_000)]).run()
    record = out.records["j"]
    # Granted at the first tick (60 s), working from 110 s: one period (1,000 + 100 s save)
    # committed by 2,000 s; the 890 s since are lost. Asks again at 2,030 s, granted at the
    # 2,040 s tick on two other nodes, restarts and does the remaining 9,000 s in 9 periods.
    assert (record.failures, record.attempts, record.first_grant_s) == (1, 2, 60)
    assert record.finished_s == 2_040 + 50 + 9_000 + 9 * 100
    assert record.kept_s == 10_000
    assert record.allocated_gpu_s == 16 * ((2_000 - 60) + (record.finished_s - 2_040))


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
    from workflows.fleet.workload import jobs, outages

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
    bad = tmp_path / "bad.toml"
    bad.write_text("dayz = 3\n")
    done = runner.invoke(cli, ["simulate", "--config", str(bad)])
    assert done.exit_code != 0 and "dayz" in str(done.exception)


def test_the_example_config_lists_the_defaults() -> None:
    import tomllib

    example = Path(__file__).resolve().parents[2] / "examples" / "simulate.toml"
    assert SimConfig.model_validate(tomllib.loads(example.read_text())) == SimConfig()
