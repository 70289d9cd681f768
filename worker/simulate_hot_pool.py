"""`forgeline simulate --hot-pool`: the same fine-tune workload three ways, side by side:
placement blind to base models (as before it counted bytes to fetch), placement by bytes to
fetch, and that with the hot pool; how long fine-tunes waited for their base model at their
start and at restarts, what was copied, and the node disk and nodes the pool held for it."""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor

from rich.table import Table

from infra.capacity_plan import daly_interval_s
from workflows.scheduling.fleet.base_models import FetchFigures
from workflows.scheduling.fleet.config import SimConfig
from workflows.scheduling.fleet.report import Report, hot_pool_steps, run

STEPS = ("blind to base models", "by bytes to fetch", "+ hot pool")


def run_steps(settings: SimConfig) -> list[tuple[SimConfig, Report]]:
    """The three, in parallel (each is minutes at the default fleet)."""
    configs = hot_pool_steps(settings)
    workers = max(1, min(len(configs), os.cpu_count() or 1))
    with ProcessPoolExecutor(workers) as pool:
        reports = list(pool.map(run, configs, [daly_interval_s] * len(configs)))
    return list(zip(configs, reports, strict=True))


def table(steps: list[tuple[SimConfig, Report]]) -> Table:
    config, last = steps[-1]
    bases = config.base_models
    title = (
        f"Fine-tunes and their base models: {last.gpus:,} GPUs, {last.days:g} days, "
        f"{bases.fine_tune_share:.0%} of the jobs of up to {bases.max_gpus} GPUs fine-tune one of "
        f"{bases.models} base models ({', '.join(f'{s:g}' for s in bases.sizes_gb)} GB), "
        f"{bases.fetch_gb_per_s:g} GB/s a node from the store, {bases.node_cache_gb:g} GB of "
        f"cache a node, hot pool {bases.hot_fraction:g} of the nodes"
    )
    result = Table(title=title)
    result.add_column("placement")
    for name in STEPS:
        result.add_column(name, justify="right")
    figures = [r.fetches for _, r in steps]
    assert all(f is not None for f in figures)  # every step has fine-tunes
    nodes = last.gpus // config.fleet.gpus_per_node
    for name, cell in _ROWS:
        result.add_row(name, *(cell(f) for f in figures if f is not None))
    result.add_row("nodes", *([f"{nodes:,}"] * len(steps)))
    result.add_row("allocation", *(f"{100 * r.allocation:.1f} %" for _, r in steps))
    result.add_row("useful GPU time", *(f"{100 * r.useful:.1f} %" for _, r in steps))
    return result


_ROWS: list[tuple[str, Callable[[FetchFigures], str]]] = [
    ("fine-tunes started", lambda f: f"{f.starts:,}"),
    ("wait for the base at start: mean", lambda f: f"{f.start_mean_s:,.1f} s"),
    ("… median / p90", lambda f: f"{f.start_p50_s:,.1f} / {f.start_p90_s:,.1f} s"),
    ("restarts still needing the base", lambda f: f"{f.restarts:,}"),
    ("… their wait for it, mean", lambda f: f"{f.restart_mean_s:,.1f} s"),
    ("copied while gangs waited", lambda f: f"{f.fetched_by_runs_tb:,.1f} TB"),
    ("copied ahead of demand (warming)", lambda f: f"{f.warmed_tb:,.1f} TB"),
    ("node disk holding hot models, mean", lambda f: f"{f.hot_tb_held:,.1f} TB"),
    ("nodes holding a hot model, mean", lambda f: f"{f.hot_nodes_held:,.0f}"),
]
