"""`forgeline api` (serve the HTTP API) and `forgeline tokens create|list|revoke` (who may call
it, an admin's business)."""

from __future__ import annotations

import getpass
from typing import Annotated

import typer
from rich.table import Table

from infra.errors import StoreError
from infra.extras import require_extra
from infra.identity import Identity, InvalidIdentity
from infra.settings import Settings
from infra.tokens import TokenError, TokenStore, caller_token
from registry.approvals import load_approvals
from registry.errors import ApprovalsInvalid
from worker.cli_common import CliError, ExitCode, console, get_settings

tokens_app = typer.Typer(help="API tokens: who may call Forgeline, with which roles (admins).")

commands = typer.Typer()
commands.add_typer(tokens_app, name="tokens")


@commands.command()
def api(
    host: Annotated[str, typer.Option(help="0.0.0.0 to accept other machines")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535)] = 8700,
) -> None:
    """Serve the HTTP API (/v1, schema at /openapi.json, docs at /docs) until stopped."""
    require_extra("control", "forgeline api")
    import uvicorn  # the server only for this command

    from worker.api import make_app

    settings = get_settings()
    _approvals_into_the_store(settings)
    uvicorn.run(make_app(settings), host=host, port=port, log_level="warning")


def _approvals_into_the_store(settings: Settings) -> None:
    """Rules a build before installed in this state folder (`approvals.toml`) reach the gate
    from the start: the control worker reads them from the store, never from here."""
    try:
        load_approvals(settings.open_store(), settings.home)
    except (StoreError, ApprovalsInvalid, OSError, UnicodeError) as err:  # the API starts anyway
        console.print(
            f"the approval rules of {settings.home} are not in the store yet ({err}): the gate "
            "applies the defaults until GET /v1/approvals copies them, or until rules are "
            "installed with `forgeline approvals apply`",
            markup=False,
        )


def _admin(store: TokenStore) -> Identity:
    """The caller, who must be an admin. Until the state folder has an admin token, whoever
    can write to the folder may make the first one (that is who installed Forgeline)."""
    if not any(r.active and "admin" in r.roles for r in store.records()):
        return Identity(person=getpass.getuser(), roles=frozenset({"admin"}), token_id="-")
    token = caller_token(store.path.parent)
    if token is None:
        raise CliError("no token: set FORGELINE_TOKEN to an admin's token", ExitCode.REFUSED)
    try:
        who = store.authenticate(token)
    except TokenError as err:
        raise CliError(str(err), ExitCode.REFUSED) from None
    if not who.is_admin:
        raise CliError(
            f"{who.person}'s token is not an admin's: tokens are an admin's business",
            ExitCode.REFUSED,
        )
    return who


@tokens_app.command("create")
def create(
    person: Annotated[str, typer.Argument(help="who the token is for")],
    role: Annotated[
        list[str],
        typer.Option(
            help="repeat for more: read, submit:TEAM, approve:TEAM, approve:model:MODEL, "
            "operate, admin (TEAM may be *)"
        ),
    ],
    note: Annotated[str, typer.Option(help="what it is for, shown by `tokens list`")] = "",
) -> None:
    """Make a token; it is printed once and stored only as a hash."""
    store = TokenStore(get_settings().home)
    try:
        token, record = store.create(person, role, created_by=_admin(store).person, note=note)
    except (TokenError, InvalidIdentity) as err:
        raise CliError(str(err)) from None
    console.print(f"token {record.id} for {record.person}: {', '.join(record.roles)}")
    console.print("shown once; give it to them (FORGELINE_TOKEN), it cannot be read back:")
    typer.echo(token)


@tokens_app.command("list")
def list_tokens() -> None:
    """Every token: id, person, roles, when made and by whom, revoked or not."""
    store = TokenStore(get_settings().home)
    _admin(store)
    try:
        records = store.records()
    except TokenError as err:
        raise CliError(str(err)) from None
    if not records:
        console.print("no tokens yet: `forgeline up` makes the local user's")
        return
    table = Table("id", "person", "roles", "created", "by", "state", "note")
    for r in records:
        state = f"revoked {r.revoked_at:%Y-%m-%d %H:%M}" if r.revoked_at else "active"
        table.add_row(
            r.id, r.person, ", ".join(r.roles), f"{r.created_at:%Y-%m-%d %H:%M}", r.created_by,
            state, r.note,
        )  # fmt: skip
    console.print(table)


@tokens_app.command("revoke")
def revoke(token_id: Annotated[str, typer.Argument(help="the id `tokens list` shows")]) -> None:
    """Revoke a token at once: the API refuses it from its next request."""
    store = TokenStore(get_settings().home)
    _admin(store)
    try:
        record = store.revoke(token_id)
    except TokenError as err:
        raise CliError(str(err)) from None
    console.print(f"token {record.id} of {record.person} is revoked")
