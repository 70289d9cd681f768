"""API tokens and the identities they carry: stored hashed, shown once, revocable, and names
compared in one canonical spelling."""

from __future__ import annotations

import json
import re
import stat
from pathlib import Path

import pytest

from infra.identity import (
    PERSON_PATTERN,
    InvalidIdentity,
    canonical_person,
    canonical_role,
)
from infra.tokens import (
    LOCAL_TOKEN_FILE,
    TOKENS_FILE,
    TokenError,
    TokenStore,
    caller_token,
    ensure_local_admin,
)
from tests.infra.store.test_local_durability import strace
from workflows.contracts.names import NAME_PATTERN


def test_a_token_is_shown_once_and_stored_as_a_hash(tmp_path: Path) -> None:
    store = TokenStore(tmp_path)
    token, record = store.create("Alice ", ["submit:research", "READ"], created_by="root")
    assert record.person == "alice" and record.roles == ("read", "submit:research")
    stored = (tmp_path / TOKENS_FILE).read_text()
    # flt_<id>_<secret>: the secret is url-safe base64, which may itself hold "_".
    secret = token.split("_", 2)[2]
    assert record.id in token and token not in stored and secret not in stored
    assert json.loads(stored)["tokens"][0]["secret_sha256"] == record.secret_sha256
    assert stat.S_IMODE((tmp_path / TOKENS_FILE).stat().st_mode) == 0o600
    who = store.authenticate(token)
    assert (who.person, who.token_id) == ("alice", record.id)
    assert who.may_submit("research") and not who.may_submit("vision")
    assert not who.may_operate() and not who.is_admin and who.may_read()


def test_a_wrong_unknown_or_revoked_token_lets_nobody_in(tmp_path: Path) -> None:
    store = TokenStore(tmp_path)
    token, record = store.create("bob", ["operate"], created_by="root")
    wrong_secret = token[:-1] + ("A" if token[-1] != "A" else "B")
    with pytest.raises(TokenError, match=f"token {record.id} is not known here"):
        store.authenticate(wrong_secret)
    with pytest.raises(TokenError, match="not a Forgeline token"):
        store.authenticate("hunter2")
    store.revoke(record.id)
    with pytest.raises(TokenError, match=f"token {record.id} of bob was revoked"):
        store.authenticate(token)
    assert store.records()[0].revoked_at is not None  # kept: who had access when
    with pytest.raises(TokenError, match="no token with id 'nope'"):
        store.revoke("nope")


def test_roles_and_names_that_break_their_rule_are_refused(tmp_path: Path) -> None:
    store = TokenStore(tmp_path)
    with pytest.raises(InvalidIdentity, match="role 'root' is not one of"):
        store.create("carol", ["root"], created_by="admin")
    with pytest.raises(TokenError, match="at least one role"):
        store.create("carol", [], created_by="admin")
    with pytest.raises(InvalidIdentity, match=re.escape("person 'carol/../x' is not a valid name")):
        canonical_person("carol/../x")
    # A look-alike from another script is someone else, and refused rather than folded.
    with pytest.raises(InvalidIdentity):
        canonical_person("аlice")  # Cyrillic а
    assert canonical_person("ＡＬＩＣＥ") == "alice"  # full-width forms are the same letters
    assert canonical_role(" Approve:Model:Shakespeare ") == "approve:model:shakespeare"
    assert not (tmp_path / TOKENS_FILE).exists()  # nothing was written for a refused token


def test_approval_roles_name_a_team_or_a_model(tmp_path: Path) -> None:
    store = TokenStore(tmp_path)
    team, _ = store.create("dave", ["approve:research"], created_by="root")
    model, _ = store.create("erin", ["approve:model:shakespeare"], created_by="root")
    admin, _ = store.create("root", ["admin"], created_by="root")
    assert store.authenticate(team).may_approve("research", "anything")
    assert not store.authenticate(team).may_approve("vision", "shakespeare")
    assert store.authenticate(model).may_approve("vision", "shakespeare")
    assert not store.authenticate(model).may_approve("vision", "other")
    boss = store.authenticate(admin)
    assert boss.may_approve("x", "y") and boss.may_submit("x") and boss.may_operate()
    assert boss.may_act_on_run_of("dave") and not store.authenticate(team).may_act_on_run_of("x")


def test_a_person_is_named_by_the_rule_of_every_other_name() -> None:
    assert PERSON_PATTERN == NAME_PATTERN  # owners and approvers are names of the workflows


def test_the_local_user_gets_one_admin_token(tmp_path: Path) -> None:
    first = ensure_local_admin(tmp_path, "alice")
    assert first.is_admin and first.person == "alice"
    token_file = tmp_path / LOCAL_TOKEN_FILE
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    assert ensure_local_admin(tmp_path, "alice").token_id == first.token_id  # kept
    assert caller_token(tmp_path, {}) == token_file.read_text().strip()
    assert caller_token(tmp_path, {"FORGELINE_TOKEN": "flt_x"}) == "flt_x"
    TokenStore(tmp_path).revoke(first.token_id)
    again = ensure_local_admin(tmp_path, "alice")  # a revoked one is replaced
    assert again.token_id != first.token_id and len(TokenStore(tmp_path).records()) == 2


REVOKE = """
import sys
from pathlib import Path
from infra.tokens import TokenStore
TokenStore(Path(sys.argv[1])).revoke(sys.argv[2])
"""


def test_a_revocation_is_on_the_disk_before_it_returns(tmp_path: Path) -> None:
    """Traced with strace: the new tokens file's data is fsynced before its rename and the
    folder after it. Before, the folder was never synced: after a power cut the old file, with
    the token still active, could come back."""
    home = tmp_path / "state"
    _, record = TokenStore(home).create("bob", ["operate"], created_by="root")
    calls = strace(REVOKE, home, Path(record.id), log=tmp_path / "revoke.strace")
    final = home.resolve() / TOKENS_FILE
    (rename,) = [i for i, c in enumerate(calls) if c.name == "rename" and c.paths[-1] == final]
    synced = {c.paths for c in calls[:rename] if c.name in ("fsync", "fdatasync")}
    assert (calls[rename].paths[0],) in synced, "the data was not fsynced before the rename"
    after = [c.paths for c in calls[rename + 1 :] if c.name in ("fsync", "fdatasync")]
    assert (final.parent,) in after, "the folder was not fsynced after the rename"
    assert TokenStore(home).records()[0].revoked_at is not None
