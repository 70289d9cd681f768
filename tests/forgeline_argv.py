"""A `forgeline …` command line from a deployment file, checked against the real CLI: every
subcommand exists and takes every option given (click parses it; nothing runs)."""

from __future__ import annotations

import click
import typer
import typer.main


def check_forgeline_argv(argv: list[str]) -> click.Command:
    """Resolve `argv` (without the leading `forgeline`) to its command and parse its options;
    click.UsageError (no such command or option) otherwise. The command, for more checks."""
    from worker.cli import app  # late: the CLI imports most of Forgeline

    command: click.Command = typer.main.get_command(app)
    args = list(argv)
    path = ["forgeline"]
    while isinstance(command, click.Group) and args and args[0] != "--help":
        name = args.pop(0)
        found = command.get_command(click.Context(command), name)
        if found is None:
            raise click.UsageError(f"{' '.join(path)} has no command {name!r}")
        path.append(name)
        command = found
    try:
        command.make_context(" ".join(path), args)  # unknown options and missing values raise
    except (click.exceptions.Exit, typer.Exit) as done:  # --help: printed, nothing to check
        assert done.exit_code == 0
    return command
