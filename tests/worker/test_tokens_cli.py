"""`forgeline tokens`: an admin's business, once a state folder has an admin."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from infra.tokens import TokenStore
from worker.cli import app
from worker.cli_common import CliError


def invoke(home: Path, *args: str, token: str | None = None):
    env = {"FORGELINE_HOME": str(home), "FORGELINE_TOKEN": token or ""}
    return CliRunner().invoke(app, list(args), env=env)


def test_the_first_admin_then_only_admins_make_tokens(tmp_path: Path) -> None:
    first = invoke(tmp_path, "tokens", "create", "root", "--role", "admin")
    assert first.exit_code == 0, first.output
    admin = first.output.strip().splitlines()[-1]
    assert TokenStore(tmp_path).authenticate(admin).is_admin

    # With an admin in the folder, a caller without a token, or with a non-admin's, is refused.
    refused = invoke(tmp_path, "tokens", "create", "eve", "--role", "admin")
    assert isinstance(refused.exception, CliError) and "no token" in str(refused.exception)
    made = invoke(tmp_path, "tokens", "create", "bob", "--role", "read", token=admin)
    bob = made.output.strip().splitlines()[-1]
    refused = invoke(tmp_path, "tokens", "create", "eve", "--role", "admin", token=bob)
    assert "bob's token is not an admin's" in str(refused.exception)
    assert [r.person for r in TokenStore(tmp_path).records()] == ["root", "bob"]

    bad = invoke(tmp_path, "tokens", "create", "eve", "--role", "sudo", token=admin)
    assert "role 'sudo' is not one of" in str(bad.exception)
    listed = invoke(tmp_path, "tokens", "list", token=admin)
    assert "bob" in listed.output and "read" in listed.output and "active" in listed.output
    bob_id = TokenStore(tmp_path).authenticate(bob).token_id
    assert invoke(tmp_path, "tokens", "revoke", bob_id, token=admin).exit_code == 0
    assert "revoked" in invoke(tmp_path, "tokens", "list", token=admin).output


@pytest.mark.parametrize("args", [["tokens", "list"], ["tokens", "revoke", "abc"]])
def test_reading_and_revoking_need_an_admin_too(tmp_path: Path, args: list[str]) -> None:
    invoke(tmp_path, "tokens", "create", "root", "--role", "admin")
    refused = invoke(tmp_path, *args)
    assert isinstance(refused.exception, CliError), refused.output
