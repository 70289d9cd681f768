"""`forgeline approvals [apply FILE]`: the operators' approval rules (registry.approvals),
through the API (GET and PUT /v1/approvals; changing them takes an admin's token).

`apply` checks the file before it replaces the installed one, so a typo never locks every run
out of approval; runs read the rules when their model is registered."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from registry.approvals import ApprovalsFile, parse_approvals
from registry.errors import ApprovalsInvalid
from worker.api_access import api_client, call
from worker.cli_common import CliError, console, get_settings

approvals_app = typer.Typer(
    help="Who may approve which models, self-approval, the eval gate.", invoke_without_command=True
)

commands = typer.Typer()
commands.add_typer(approvals_app, name="approvals")


@approvals_app.callback()
def show(ctx: typer.Context) -> None:
    """The installed rules (with no subcommand)."""
    if ctx.invoked_subcommand is not None:
        return
    installed = call(api_client(get_settings()).approvals)
    if installed == ApprovalsFile():
        console.print(
            "no approval rules: anyone but the submitter may approve, no eval gate beyond the "
            "runs' own; install rules with `forgeline approvals apply FILE`"
        )
        return
    console.print(describe(installed), markup=False)


@approvals_app.command("apply")
def apply(
    file: Annotated[Path, typer.Argument(help="TOML: [defaults], [teams.X], [models.X]")],
) -> None:
    """Check the rules and install them for the runs that reach approval from now on."""
    if not file.is_file():
        raise CliError(f"{file} does not exist")
    # Read once: what is checked is exactly what is installed, even if the file changes now.
    try:
        raw = file.read_bytes()
        text = raw.decode("utf-8")
    except OSError as err:
        raise CliError(f"cannot read {file}: {err.strerror or err}") from None
    except UnicodeDecodeError as err:
        raise CliError(_not_utf8(file, err)) from None
    try:
        rules = parse_approvals(text, str(file))
    except ApprovalsInvalid as err:
        raise CliError(str(err)) from None
    call(lambda: api_client(get_settings()).apply_approvals(rules))
    console.print(f"installed the rules of {file}", markup=False)
    console.print(describe(rules), markup=False)


def _not_utf8(path: Path, err: UnicodeDecodeError) -> str:
    return f"{path} is not UTF-8 text (a bad byte at offset {err.start}): TOML files are UTF-8"


def describe(rules: ApprovalsFile) -> str:
    lines = []
    sections = [("defaults", rules.defaults)]
    sections += [(f"team {name}", r) for name, r in sorted(rules.teams.items())]
    sections += [(f"model {name}", r) for name, r in sorted(rules.models.items())]
    for name, r in sections:
        parts = [f"approvers {', '.join(r.approvers) or '-'}"]
        if r.allow_self_approval is not None:
            parts.append(f"self-approval {'on' if r.allow_self_approval else 'off'}")
        if r.max_val_loss is not None:
            parts.append(f"gate val_loss <= {r.max_val_loss:g}")
        lines.append(f"{name:<20} " + "; ".join(parts))
    return "\n".join(lines)
