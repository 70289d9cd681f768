"""`forgeline`: bring up the local stack, submit runs, watch them, approve what they produce."""

from __future__ import annotations

import logging
import os
import sys
import traceback
from typing import Annotated

import typer
from rich.markup import escape
from temporalio.service import RPCError

from infra.capacity_hardware import PlanError
from infra.errors import InfraError, IntegrityError, InvalidKey, ObjectNotFound
from infra.extras import MissingExtra
from infra.host_network import HostNetworkError
from infra.settings import SettingsError
from worker import (
    api_cli,
    approvals_cli,
    chaos,
    cluster_cli,
    data_cli,
    hosts_cli,
    lineage,
    logs_cli,
    plan_cli,
    processes_cli,
    replication_cli,
    runs_cli,
    serve_cli,
    simulate_cli,
    stack_cli,
)
from worker.cli_common import CliError, ExitCode, console, print_version
from worker.data_cli import DataCliError
from worker.runs import RunNotFound

app = typer.Typer(help=__doc__, no_args_is_help=True)


@app.callback()
def _options(
    show_version: Annotated[
        bool,
        typer.Option(
            "--version", callback=print_version, is_eager=True, help="print the version and exit"
        ),
    ] = False,
) -> None:
    """Bring up the local stack, submit runs, watch them, approve what they produce."""


# Each module owns its commands (and its groups: `data`, `cluster`, `node`, ...); this one only
# puts them together, in the order `forgeline --help` lists them.
for module in (stack_cli, runs_cli, approvals_cli, data_cli, cluster_cli, lineage, serve_cli,
               logs_cli, chaos, plan_cli, simulate_cli, api_cli, hosts_cli, replication_cli,
               processes_cli):  # fmt: skip
    app.add_typer(module.commands)


def outcome(err: BaseException) -> tuple[str, ExitCode] | None:
    """What `forgeline` prints and exits with for an error it expects (bad input, a refusal, a
    stack that is down), or None for anything else: a bug, which keeps its traceback."""
    if isinstance(err, CliError):
        return str(err), err.code
    if isinstance(err, RunNotFound | ObjectNotFound):
        return str(err), ExitCode.NOT_FOUND
    # A bad setting, a plan or a host network that cannot be, an extra not installed, a
    # corrupt object: the message names the setting or the object, and the fix.
    if isinstance(err, DataCliError | SettingsError | PlanError | HostNetworkError | MissingExtra
                  | IntegrityError | InvalidKey):  # fmt: skip
        return str(err), ExitCode.BAD_INPUT
    # A store or a stack process that did not answer or would not start.
    if isinstance(err, InfraError):
        return str(err), ExitCode.DOWN
    if isinstance(err, RPCError | TimeoutError):
        reason = err or type(err).__name__
        return f"Temporal did not answer ({reason}): is the stack up? `forgeline up`", ExitCode.DOWN
    return None


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    code = 0
    try:
        app()
    except SystemExit as done:  # typer ends every command this way
        code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    except Exception as err:
        expected = outcome(err)
        if expected is None:
            traceback.print_exc()
            code = ExitCode.BUG
        else:
            # Escaped: messages quote TOML sections and paths, whose [brackets] are not markup.
            console.print(f"[red]error:[/red] {escape(expected[0])}")
            code = expected[1]
    # Skip interpreter finalisation: the Temporal client's core threads can still hold Python
    # objects then, and releasing them in a finalising interpreter aborts the process
    # ("PyGILState_Release ... finalizing", seen in about one `up` in five here). Everything
    # this process owns is flushed or closed by now.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
