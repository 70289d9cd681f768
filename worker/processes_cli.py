"""`forgeline worker …`: the processes `forgeline up` starts (hidden: not for direct use).

Each command only reads its settings and hands over to the process's main loop, imported late so
that one kind of process does not pay for another's imports (torch, mlflow, boto3).
"""

from __future__ import annotations

from typing import Annotated

import typer

from worker.cli_common import (
    UnconfinedOption,
    check_name,
    checked_unconfined_form,
    get_settings,
    parse_topology,
)
from worker.cli_common import run as run_async

worker_app = typer.Typer(help="Processes started by `forgeline up` (not for direct use).")

commands = typer.Typer()
commands.add_typer(worker_app, name="worker", hidden=True)


@worker_app.command("control")
def control_worker() -> None:
    from worker.processes_main import run_control_worker

    run_async(run_control_worker(get_settings()))


@worker_app.command("replicator")
def replicator_process(
    interval: Annotated[float, typer.Option(help="seconds between passes")] = 2.0,
) -> None:
    from worker.replication_cli import run_replicator

    run_replicator(get_settings(), interval)


@worker_app.command("data")
def data_worker(name: Annotated[str, typer.Option()] = "data-0") -> None:
    from worker.processes_main import run_data_worker

    run_async(run_data_worker(get_settings(), check_name(name, "worker name")))


@worker_app.command("node")
def node_agent(
    node_id: Annotated[str, typer.Option()],
    gpus: Annotated[int, typer.Option(min=1)] = 1,
    pod: Annotated[str, typer.Option(help="fabric island this node belongs to")] = "local",
    topology: Annotated[
        str, typer.Option(help="where it sits inside its pod: block=b1,rack=r3")
    ] = "",
    incarnation: Annotated[str | None, typer.Option()] = None,
    peak_flops: Annotated[
        float | None,
        typer.Option(
            min=1.0,
            help="a slot's peak FLOP/s, measured by `forgeline up` (default: measured here, now)",
        ),
    ] = None,
    unconfined_user_code: UnconfinedOption = None,
) -> None:
    """One pretend node of the local stack: `gpus` CPU rank slots on loopback."""
    from infra.node_hardware import discover
    from worker.processes_main import run_node_agent

    checked_unconfined_form(unconfined_user_code)
    node_id = check_name(node_id, "node id")
    hardware = discover(slots=gpus, cpu_only=True, measured_peak=peak_flops)
    run_async(
        run_node_agent(
            get_settings(),
            node_id,
            hardware,
            pod=check_name(pod, "pod"),
            incarnation=incarnation,
            topology=parse_topology(topology),
            unconfined_user_code=unconfined_user_code,
        )
    )
