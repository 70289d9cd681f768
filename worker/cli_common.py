"""What every `forgeline` command shares: the console, one-line errors, reaching Temporal."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable
from enum import IntEnum
from typing import Annotated, TypeVar

import typer
from rich.console import Console
from temporalio.client import Client
from temporalio.runtime import Runtime

from infra.mlflow_login import use_local_login
from infra.settings import Settings, load_settings
from worker.temporal_client import connect
from workflows.contracts import names

# Piped output (logs, tests) gets wide tables instead of rich's 80-column default.
console = Console(highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else 200)
T = TypeVar("T")


class ExitCode(IntEnum):
    """What `forgeline` exits with, one code per kind of outcome, for scripts to branch on
    (the README lists them)."""

    OK = 0
    RUN_FAILED = 1  # the run ended FAILED, CANCELLED or REJECTED; a lineage hash is broken
    USAGE = 2  # click's own: an unknown command or option, a missing argument
    BAD_INPUT = 3  # a spec, name, file or value refused before anything started
    NOT_FOUND = 4  # no such run, model version, node, token or log
    REFUSED = 5  # not allowed (no token, not the role), or the run's state or gate refuses it
    DOWN = 6  # the API, Temporal, MLflow or the store did not answer
    BUG = 70  # a defect in Forgeline: the traceback is printed (sysexits' EX_SOFTWARE)


class CliError(Exception):
    """Shown to the user as one line, without a traceback; `code` is the exit code."""

    def __init__(self, message: str, code: ExitCode = ExitCode.BAD_INPUT) -> None:
        super().__init__(message)
        self.code = code


def print_version(asked: bool) -> None:
    """`forgeline --version`: the installed distribution's version, then exit."""
    if asked:
        from infra.installed import forgeline_version

        found = forgeline_version()
        typer.echo(f"forgeline {found or '(not installed: pip install -e .)'}")
        raise typer.Exit()


def run(coro: Awaitable[T]) -> T:
    return asyncio.run(coro)  # type: ignore[arg-type]


def get_settings() -> Settings:
    settings = load_settings()
    # The local stack's MLflow answers only to Forgeline's login (infra.mlflow_login): this
    # process is Forgeline's, run by whoever owns the state folder.
    use_local_login(settings.home, settings.mlflow_uri)
    return settings


async def get_client(
    settings: Settings,
    fix: str = "start the local stack with `forgeline up`",
    runtime: Runtime | None = None,
) -> Client:
    try:
        return await connect(settings, runtime)
    except RuntimeError as err:
        reason = "connection refused" if "Connection refused" in str(err) else str(err)[:200]
        raise CliError(
            f"cannot reach Temporal at {settings.temporal_address} ({reason}): {fix}",
            ExitCode.DOWN,
        ) from None


def check_name(name: str, what: str = "run name") -> str:
    """Before a name becomes a workflow id, a store key or a folder (the rule of
    workflows.contracts.names)."""
    try:
        return names.check_name(name, what)
    except names.InvalidName as err:
        raise CliError(str(err)) from None


def parse_topology(text: str) -> dict[str, str]:
    """An agent's `--topology`: "block=b1,rack=r3", where the node sits inside its pod, one
    unit per level of the cluster file's `levels`."""
    topology: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        level, sep, unit = part.partition("=")
        if not sep or not level.strip() or not unit.strip():
            raise CliError(f"--topology: {part!r} is not LEVEL=UNIT: write it as block=b1,rack=r3")
        level = check_name(level.strip(), "topology level")
        if level in topology:
            raise CliError(f"--topology: level {level!r} is given twice")
        topology[level] = check_name(unit.strip(), f"{level} name")
    return topology


UnconfinedOption = Annotated[
    str | None,
    typer.Option(
        envvar="FORGELINE_UNCONFINED_USER_CODE",
        help="run users' code without a box, as this agent runs (it then reads what the agent "
        "reads): takes exactly user-code-sees-what-this-agent-sees. Without it, a host that "
        "cannot box ranks (no bwrap, no user namespaces) refuses user code",
    ),
]


def checked_unconfined_form(value: str | None) -> None:
    """--unconfined-user-code with anything but its explicit value stops the agent at once."""
    from trainer.rank_box import UnconfinedFormError, check_unconfined_form

    try:
        check_unconfined_form(value)
    except UnconfinedFormError as err:
        raise CliError(str(err)) from None
