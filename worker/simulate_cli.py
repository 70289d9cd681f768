"""`forgeline simulate [--config FILE] [--days N] [--seed S] [--compare] [--out DIR]`.

A datacenter's weeks in a minute or two, through the real scheduling policy
(`workflows/scheduling/fleet/`).
The checkpoint interval of every job is Daly's for its save cost and its
gang's MTBF (`infra.capacity_plan.daly_interval_s`, the rule `checkpoint_every = "auto"` uses),
passed in from here because `workflows/` may not import `infra`.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Annotated

import typer
from pydantic import ValidationError
from rich.table import Table

from infra.capacity_plan import daly_interval_s
from infra.extras import require_extra
from infra.toml_files import read_toml
from worker import simulate_hot_pool as hot_pool
from worker.cli_common import CliError, console
from workflows.scheduling.fleet.config import Recovery, SimConfig
from workflows.scheduling.fleet.report import Report, compare, recovery_steps, run

commands = typer.Typer()

DEFAULT_OUT = Path("reports/simulate")


def load_config(path: Path | None) -> SimConfig:
    if path is None:
        return SimConfig()
    data = read_toml(path, CliError, "simulation settings")
    # TOML has inf and nan; no setting means them, and inf days would never end.
    for where, value in _numbers(data):
        if not math.isfinite(value):
            raise CliError(f"{path}: {where}: {value} is not a finite number")
    try:
        return SimConfig.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "(top level)"
        raise CliError(f"{path}: {where}: {first['msg']}") from err


def _numbers(data: object, where: str = "") -> Iterator[tuple[str, float]]:
    """Every float in a TOML table, with its dotted key."""
    if isinstance(data, dict):
        for key, value in data.items():
            yield from _numbers(value, f"{where}.{key}" if where else str(key))
    elif isinstance(data, list):
        for index, value in enumerate(data):
            yield from _numbers(value, f"{where}.{index}")
    elif isinstance(data, float):
        yield where, data


def _pct(x: float) -> str:
    return f"{100 * x:.1f} %"


def _cost(r: Report) -> str:
    """The work preemptions threw away, the saves they forced and the restarts they paid."""
    return f"{100 * r.preemption_cost:.2f} / {100 * r.yielded_cost:.2f} %"


def _summary(r: Report, seconds: float) -> Table:
    table = Table(title=f"Simulation: {r.gpus:,} GPUs, {r.days:g} days, policy {r.policy}")
    table.add_column("figure")
    table.add_column("value", justify="right")
    rows = [
        ("offered work (of healthy GPU-time)", _pct(r.offered)),
        ("allocation (target ≥ 85 %)", _pct(r.allocation)),
        ("useful GPU time (target ≥ 75 %)", _pct(r.useful)),
        *((f"idle: {cause}", _pct(share)) for cause, share in r.idle.items()),
        ("idle: between passes", _pct(1 - r.allocation - sum(r.idle.values()))),
        ("preemptions / of them yielders leaving", f"{r.preemptions:,} / {r.yielded:,}"),
        ("GPU-time preemptions cost: others / yielders", _cost(r)),
        ("node failures under a gang", f"{r.failures_under_jobs:,}"),
        ("recoveries / of them on a spare", f"{r.recoveries:,} / {r.spare_hits:,}"),
        ("still waiting at the end", f"{r.still_waiting:,}"),
        ("scheduling passes / longest queue", f"{r.passes:,} / {r.max_queue:,}"),
        ("wall-clock", f"{seconds:.1f} s"),
    ]
    for row in rows:
        table.add_row(*row)
    return table


def _classes(r: Report) -> Table:
    table = Table(title="Per job-size class (GPUs)")
    for name in ("class", "jobs", "finished", "GPU-h share", "goodput", "wait p50", "wait p99",
                 "starved", "requeued, longest wait", "preempted", "failures"):  # fmt: skip
        table.add_column(name, justify="left" if name == "class" else "right")
    for c in r.classes:
        table.add_row(
            c.name, f"{c.jobs:,}", f"{c.finished:,}", _pct(c.gpu_hours_share), _pct(c.goodput),
            f"{c.wait_p50_h:.2f} h", f"{c.wait_p99_h:.1f} h", f"{c.starved:,}",
            f"{c.requeued_wait_max_h:.1f} h", f"{c.preemptions:,}", f"{c.failures:,}",
        )  # fmt: skip
    return table


def _big_runs(r: Report) -> Table:
    table = Table(title="The biggest runs")
    for name in ("run", "submitted", "waited", "progress", "goodput", "… waits counted",
                 "attempts", "failures", "waits to recover"):  # fmt: skip
        table.add_column(name, justify="left" if name == "run" else "right")
    for b in r.big_runs:
        table.add_row(
            b.run_id, f"day {b.submitted_h / 24:.1f}", f"{b.waited_h:.1f} h", _pct(b.progress),
            _pct(b.goodput), _pct(b.goodput_with_waits), str(b.attempts), str(b.failures),
            f"{b.recovery_wait_h:.1f} h",
        )  # fmt: skip
    return table


def _comparison(reports: list[Report]) -> Table:
    table = Table(title="Policies on the same seed (each adds to the one above)")
    columns = ["policy", "allocation", "useful", "idle: nothing queued", "idle: reserved",
               "preemptions / yielders", "their cost: others / yielders", "spare hits",
               "still waiting", "requeued: longest wait"]  # fmt: skip
    columns += [f"wait p50/p99 {c.name}" for c in reports[0].classes]
    for name in columns:
        table.add_column(name, justify="left" if name == "policy" else "right")
    for r in reports:
        waits = [f"{c.wait_p50_h:.1f} / {c.wait_p99_h:.0f} h" for c in r.classes]
        table.add_row(r.policy, _pct(r.allocation), _pct(r.useful),
                      _pct(r.idle["nothing queued"]), _pct(r.idle["reserved"]),
                      f"{r.preemptions:,} / {r.yielded:,}", _cost(r), f"{r.spare_hits:,}",
                      f"{r.still_waiting:,}",
                      f"{max(c.requeued_wait_max_h for c in r.classes):.1f} h",
                      *waits)  # fmt: skip
    return table


def _big_goodput(r: Report, *, with_waits: bool = False) -> str:
    if not r.big_runs:
        return "-"
    values = sorted(b.goodput_with_waits if with_waits else b.goodput for b in r.big_runs)
    return _pct(values[0]) if len(values) == 1 else f"{_pct(values[0])} – {_pct(values[-1])}"


def _recovery_comparison(steps: list[tuple[str, Report]], simulated: Recovery) -> Table:
    table = Table(title="Recovery as it was, then each gain of the stack in turn (same seed)")
    first = steps[0][1]
    columns = ["recovery", "allocation", "useful", "preemptions / yielders"]
    columns += [f"goodput {c.name}" for c in first.classes]
    columns += ["biggest runs' goodput", "… waits to recover counted", "wait to recover (mean)",
                "shrunk"]  # fmt: skip
    for name in columns:
        table.add_column(name, justify="left" if name == "recovery" else "right")
    for name, r in steps:
        name += " (the model)" if r.recovery == simulated else ""
        waited_h = sum(c.recovery_wait_h * c.failures for c in r.classes)
        failures = sum(c.failures for c in r.classes)
        table.add_row(
            name, _pct(r.allocation), _pct(r.useful), f"{r.preemptions:,} / {r.yielded:,}",
            *[_pct(c.goodput) for c in r.classes], _big_goodput(r),
            _big_goodput(r, with_waits=True),
            f"{60 * waited_h / failures if failures else 0:.1f} min",
            f"{sum(c.shrunk for c in r.classes):,}",
        )  # fmt: skip
    return table


def _run_steps(settings: SimConfig) -> list[tuple[str, Report]]:
    """Every step of the recovery model on the same seed, in parallel (each is minutes)."""
    steps = recovery_steps(settings.recovery)
    configs = [settings.model_copy(update={"recovery": model}) for _, model in steps]
    workers = max(1, min(len(configs), os.cpu_count() or 1))
    with ProcessPoolExecutor(workers) as pool:
        reports = list(pool.map(run, configs, [daly_interval_s] * len(configs)))
    return [(name, r) for (name, _), r in zip(steps, reports, strict=True)]


def plot(reports: list[Report], warmup_days: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display here
    from matplotlib.figure import Figure

    figure = Figure(figsize=(11, 4.5))
    axes = figure.subplots()
    for r in reports:
        days = [h / 24 for h in range(len(r.hourly_allocation))]
        allocated = [100 * x for x in r.hourly_allocation]
        line = axes.plot(days, allocated, label=f"{r.policy}: allocated")
        if len(reports) == 1:
            axes.plot(days, [100 * x for x in r.hourly_useful], label="useful",
                      color=line[0].get_color(), linestyle="--")  # fmt: skip
    axes.axvspan(0, warmup_days, color="grey", alpha=0.15, label="warm-up (not measured)")
    axes.axhline(85, color="black", linewidth=0.8, linestyle=":", label="target 85 %")
    axes.set(xlabel="day", ylabel="% of healthy GPUs", ylim=(0, 100),
             title="GPU utilisation over time (hourly)")  # fmt: skip
    axes.legend(loc="lower right", fontsize=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110, bbox_inches="tight")


@commands.command()
def simulate(
    config: Annotated[
        Path | None, typer.Option("--config", help="TOML (examples/simulate.toml)")
    ] = None,
    days: Annotated[float | None, typer.Option(help="simulated days (default 21)")] = None,
    seed: Annotated[int | None, typer.Option(help="the workload's and failures' seed")] = None,
    compare_policies: Annotated[
        bool, typer.Option("--compare", help="FIFO vs backfill vs preemption vs spares")
    ] = False,
    compare_recovery: Annotated[
        bool,
        typer.Option("--recovery", help="recovery as it was, then each gain of the stack"),
    ] = False,
    compare_hot_pool: Annotated[
        bool,
        typer.Option(
            "--hot-pool", help="fine-tunes: placement blind to base models, by bytes, + hot pool"
        ),
    ] = False,
    out: Annotated[Path, typer.Option(help="where the PNG goes")] = DEFAULT_OUT,
) -> None:
    """Simulate the datacenter through the real scheduling policy: utilisation, goodput, waits."""
    require_extra("plots", "forgeline simulate (its utilisation plot)")  # before minutes of work
    if days is not None and not math.isfinite(days):  # click's FLOAT takes "inf" and "nan"
        raise CliError(f"--days {days}: give a finite number of days, e.g. 21")
    settings = load_config(config)
    updates = {k: v for k, v in (("days", days), ("seed", seed)) if v is not None}
    try:
        settings = SimConfig.model_validate(settings.model_dump() | updates)
    except ValidationError as err:
        raise CliError(f"--days/--seed: {err.errors()[0]['msg']}") from err
    if compare_policies + compare_recovery + compare_hot_pool > 1:
        raise CliError("--compare, --recovery and --hot-pool: choose one comparison")
    started = time.perf_counter()
    if compare_hot_pool:
        steps = hot_pool.run_steps(settings)
        console.print(hot_pool.table(steps))
        console.print(f"{len(steps)} placements in {time.perf_counter() - started:.1f} s")
        return
    if compare_recovery:
        steps = _run_steps(settings)
        console.print(_recovery_comparison(steps, settings.recovery))
        console.print(f"{len(steps)} recovery models in {time.perf_counter() - started:.1f} s")
        model = next(r for _, r in steps if r.recovery == settings.recovery)
        console.print(_big_runs(model))
        return
    if compare_policies:
        reports = compare(settings, daly_interval_s)
        seconds = time.perf_counter() - started
        console.print(_comparison(reports))
        console.print(f"{len(reports)} policies in {seconds:.1f} s")
        path = out / "utilisation-compare.png"
    else:
        reports = [run(settings, daly_interval_s)]
        seconds = time.perf_counter() - started
        for table in (_summary(reports[0], seconds), _classes(reports[0]), _big_runs(reports[0])):
            console.print(table)
        path = out / "utilisation.png"
    plot(reports, settings.warmup_days, path)
    console.print(f"utilisation over time: {path}")
