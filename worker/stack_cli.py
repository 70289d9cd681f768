"""`forgeline up` and `down`: the local stack, and where its pages are."""

from __future__ import annotations

from typing import Annotated

import typer

from infra import mlflow_login
from infra.errors import StackError
from infra.settings import Settings, state_home
from infra.tokens import LOCAL_TOKEN_FILE
from worker import stack
from worker.cli_common import CliError, ExitCode, console

commands = typer.Typer()


def print_links(settings: Settings) -> None:
    namespace = settings.temporal_namespace
    console.print(f"Temporal UI  {settings.temporal_ui_url}/namespaces/{namespace}/workflows")
    login = mlflow_login.read(settings.home)
    sign_in = ""
    if login is not None and login.uri == settings.mlflow_uri:
        sign_in = (
            f"  (sign in as {mlflow_login.VIEWER}, password {login.viewer_password}: read-only)"
        )
    console.print(f"MLflow UI    {settings.mlflow_uri}{sign_in}", soft_wrap=True)
    console.print(f"API          {settings.api_url}/docs")
    console.print(
        f"Cluster page {settings.api_url}/  (paste your token: {settings.home / LOCAL_TOKEN_FILE})",
        soft_wrap=True,
    )
    console.print(
        f"Metrics      {settings.api_url}/metrics (the fleet, with a token); each worker's and "
        f"agent's address in {settings.home / 'run'}/*.metrics",
        soft_wrap=True,
    )


@commands.command()
def up(
    nodes: Annotated[int, typer.Option(min=1, max=64, help="node agents to run")] = 2,
    gpus_per_node: Annotated[int, typer.Option(min=1, max=64, help="rank slots per node")] = 1,
    temporal_port: Annotated[int | None, typer.Option(help="default 7233, or a free port")] = None,
    ui_port: Annotated[int | None, typer.Option(help="default 8233, or a free port")] = None,
    mlflow_port: Annotated[int | None, typer.Option(help="default 5000, or a free port")] = None,
    api_port: Annotated[int | None, typer.Option(help="default 8700, or a free port")] = None,
    data_workers: Annotated[
        int, typer.Option(min=1, max=64, help="data-preparation workers (more = faster)")
    ] = 1,
    spares: Annotated[
        int | None,
        typer.Option(
            min=0,
            max=64,
            help="that many more node agents, held back (any healthy idle ones) for gangs "
            "recovering from a failure; 0 frees the pool; default: as the cluster has it",
        ),
    ] = None,
) -> None:
    """Start the local stack (idempotent): Temporal, MLflow, workers, node agents."""
    ports = stack.Ports(temporal=temporal_port, ui=ui_port, mlflow=mlflow_port, api=api_port)
    try:
        settings = stack.up(
            state_home(),
            nodes,
            gpus_per_node,
            ports,
            data_workers,
            say=console.print,
            spares=spares,
        )
    except StackError as err:  # a process that would not start, a server that does not answer
        raise CliError(str(err), ExitCode.DOWN) from None
    console.print(f"state folder {settings.home}")
    print_links(settings)


@commands.command()
def down() -> None:
    """Stop everything `forgeline up` started from this state folder."""
    stack.down(state_home(), say=console.print)
