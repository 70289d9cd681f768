"""`forgeline nodes | queues | jobs`, `forgeline node drain|undrain|cordon NODE`,
`forgeline cluster apply FILE`: what operators see and change."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated

import typer
from pydantic import ValidationError

from infra.toml_files import read_toml
from worker.api_access import api_client, call
from worker.cli_common import CliError, check_name, console, get_settings
from worker.cluster_render import hot_pool_lines, jobs_table, nodes_table, queues_table
from worker.specfile import explain_errors
from workflows.contracts.cluster_models import ClusterConfig, ClusterState, Node

cluster_app = typer.Typer(help="The cluster's configuration: pods, queues, spares.")
node_app = typer.Typer(help="Take a node out of service or put it back.")

commands = typer.Typer()
commands.add_typer(cluster_app, name="cluster")
commands.add_typer(node_app, name="node")


def _cluster_state() -> ClusterState:
    return call(api_client(get_settings()).cluster)


# The tables are views of one state: --json prints that state whole (as GET /v1/cluster).
ClusterJson = Annotated[
    bool, typer.Option("--json", help="the cluster's whole state as JSON (GET /v1/cluster)")
]


def _printed_as_json(state: ClusterState, as_json: bool) -> bool:
    if as_json:
        typer.echo(state.model_dump_json(indent=2))
    return as_json


@commands.command()
def nodes(as_json: ClusterJson = False) -> None:
    """The nodes: pod, GPUs in use, state, jobs, cached datasets."""
    state = _cluster_state()
    if not _printed_as_json(state, as_json):
        console.print(nodes_table(state))


@commands.command()
def queues(as_json: ClusterJson = False) -> None:
    """The queues (teams): guaranteed, max, in use, borrowed, pending GPUs."""
    state = _cluster_state()
    if _printed_as_json(state, as_json):
        return
    console.print(queues_table(state))
    total = sum(n.info.gpus for n in state.nodes)
    used = sum(n.used for n in state.nodes)
    cost = used * state.config.cost_per_gpu_hour
    console.print(
        f"cluster: {used}/{total} GPUs in use, {cost:,.2f} per hour at the configured rate"
    )
    for line in hot_pool_lines(state, datetime.now(UTC)):
        console.print(line)


@commands.command()
def jobs(as_json: ClusterJson = False) -> None:
    """Running gangs, and waiting ones with their place in line and why they wait."""
    state = _cluster_state()
    if _printed_as_json(state, as_json):
        return
    console.print(jobs_table(state))
    if state.reservation:
        r = state.reservation
        console.print(
            f"reservation: {r.run_id} on {', '.join(r.nodes)} from {r.start:%Y-%m-%d %H:%M:%S} UTC"
        )


def load_cluster_config(path: Path) -> ClusterConfig:
    data = read_toml(path, CliError, "cluster file")
    try:
        return ClusterConfig.model_validate(data)
    except ValidationError as err:
        raise CliError(f"{path}: invalid cluster file:\n  {explain_errors(err)}") from None


@cluster_app.command("apply")
def apply(file: Annotated[Path, typer.Argument(help="cluster file (TOML)")]) -> None:
    """Declare pods, the queue tree, the spare pool, cost and preemption grace."""
    config = load_cluster_config(file)
    applied = call(lambda: api_client(get_settings()).apply_cluster(config))
    console.print(
        f"applied: {len(applied.queues)} queue(s), {len(applied.pods)} pod(s), "
        f"{applied.spare_nodes} spare node(s), preemption grace {applied.preemption_grace_s} s"
    )


def _set_admin(node_id: str, action: str) -> Node:
    check_name(node_id, "node id")
    node = call(lambda: api_client(get_settings()).node(node_id, action))
    console.print(
        f"{node.info.node_id}: {node.state}"
        + (f", running {', '.join(node.jobs)}" if node.jobs else "")
    )
    return node


@node_app.command("drain")
def drain(node: Annotated[str, typer.Argument(help="node id")]) -> None:
    """No new work; the gangs on it checkpoint within the grace period and move elsewhere."""
    _set_admin(node, "drain")


@node_app.command("cordon")
def cordon(node: Annotated[str, typer.Argument(help="node id")]) -> None:
    """No new work; what runs there keeps running."""
    _set_admin(node, "cordon")


@node_app.command("undrain")
def undrain(node: Annotated[str, typer.Argument(help="node id")]) -> None:
    """Back in service (after drain or cordon)."""
    _set_admin(node, "undrain")
