"""API tokens: made once, shown once, stored hashed (`tokens.json` in the state folder).

A token reads `flt_<id>_<secret>`: the id finds its record, the secret proves it. Only the
secret's sha256 is stored: the secret is 32 random bytes, so a fast hash is as safe as a slow
one (there is nothing to guess), and a stolen `tokens.json` lets nobody in. Revoked tokens stay
in the file, so a revoked id is never reissued and the list shows who had access when.
"""

from __future__ import annotations

import contextlib
import fcntl
import hmac
import os
import re
import secrets
from collections.abc import Iterator, Mapping
from datetime import UTC, datetime
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from infra.digest import sha256_bytes
from infra.durable import replace_durably
from infra.identity import Identity, canonical_person, canonical_role

TOKENS_FILE = "tokens.json"
PREFIX = "flt"
# What a token looks like, also to find one printed in a log (infra.secret_shapes).
TOKEN_SHAPE = rf"{PREFIX}_([0-9a-f]{{12}})_([A-Za-z0-9_-]{{43}})"
_TOKEN = re.compile(rf"^{TOKEN_SHAPE}$")


class TokenError(Exception):
    """A token that does not let its bearer in (the message says why, never the secret)."""


class TokenRecord(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    id: str = Field(pattern=r"^[0-9a-f]{12}$")
    person: str
    roles: tuple[str, ...]
    secret_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    created_at: datetime
    created_by: str
    note: str = ""
    revoked_at: datetime | None = None

    @property
    def active(self) -> bool:
        return self.revoked_at is None


class TokensFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    version: int = 1
    tokens: list[TokenRecord] = []


class TokenStore:
    """The tokens of one state folder. Every change holds a lock on the folder's
    `tokens.lock`, so the API and a CLI creating tokens at once do not lose one another's."""

    def __init__(self, home: Path) -> None:
        self.path = home / TOKENS_FILE
        self._lock_path = home / "tokens.lock"

    def records(self) -> list[TokenRecord]:
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return []
        try:
            return TokensFile.model_validate_json(raw).tokens
        except ValidationError as err:
            raise TokenError(
                f"{self.path} is not a tokens file Forgeline wrote ({err.error_count()} "
                "problems): restore it from a backup, or move it away and make new tokens"
            ) from None

    def create(
        self, person: str, roles: list[str], created_by: str, note: str = ""
    ) -> tuple[str, TokenRecord]:
        """A new token for `person` with `roles`: the token itself (shown once, never stored)
        and its record."""
        record_roles = tuple(sorted({canonical_role(role) for role in roles}))
        if not record_roles:
            raise TokenError("a token needs at least one role (e.g. --role read)")
        secret = secrets.token_urlsafe(32)
        with self._locked():
            known = self.records()
            taken = {r.id for r in known}
            token_id = secrets.token_hex(6)
            while token_id in taken:
                token_id = secrets.token_hex(6)
            record = TokenRecord(
                id=token_id,
                person=canonical_person(person),
                roles=record_roles,
                secret_sha256=sha256_bytes(secret.encode()),
                created_at=datetime.now(UTC),
                created_by=created_by,
                note=note,
            )
            self._write([*known, record])
        return f"{PREFIX}_{token_id}_{secret}", record

    def revoke(self, token_id: str) -> TokenRecord:
        with self._locked():
            known = self.records()
            found = next((r for r in known if r.id == token_id), None)
            if found is None:
                raise TokenError(f"no token with id {token_id!r}: see `forgeline tokens list`")
            if not found.active:
                return found
            revoked = found.model_copy(update={"revoked_at": datetime.now(UTC)})
            self._write([revoked if r.id == token_id else r for r in known])
        return revoked

    def authenticate(self, token: str) -> Identity:
        """The identity a token carries; TokenError when it is malformed, unknown or revoked."""
        found = _TOKEN.fullmatch(token.strip())
        if found is None:
            raise TokenError(
                f"not a Forgeline token (they read {PREFIX}_<12 hex digits>_<secret>): "
                "ask an admin for one (`forgeline tokens create`)"
            )
        token_id, secret = found.groups()
        record = next((r for r in self.records() if r.id == token_id), None)
        # Compared in constant time, and the same answer for an unknown id and a wrong secret.
        digest = sha256_bytes(secret.encode())
        if record is None or not hmac.compare_digest(digest, record.secret_sha256):
            raise TokenError(f"token {token_id} is not known here: ask an admin for a new one")
        if not record.active:
            raise TokenError(
                f"token {token_id} of {record.person} was revoked at "
                f"{record.revoked_at:%Y-%m-%d %H:%M} UTC: ask an admin for a new one"
            )
        return Identity(person=record.person, roles=frozenset(record.roles), token_id=record.id)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self._lock_path, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield

    def _write(self, records: list[TokenRecord]) -> None:
        # A file of hashes is no secret, but who may do what is nobody else's business.
        write_private(self.path, TokensFile(tokens=records).model_dump_json(indent=2).encode())


def write_private(path: Path, data: bytes) -> None:
    """Replace `path` whole or not at all, readable by its owner only, and durably: a revoked
    token must stay revoked after a power cut, so the rename is synced into its folder too."""
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(data)
    replace_durably(tmp, path)


LOCAL_TOKEN_FILE = "token"


def caller_token(home: Path, environ: Mapping[str, str] | None = None) -> str | None:
    """The token a command on this machine presents: FORGELINE_TOKEN, else the state folder's
    `token` (the local user's, made by `forgeline up`)."""
    env = os.environ if environ is None else environ
    if env.get("FORGELINE_TOKEN"):
        return env["FORGELINE_TOKEN"]
    with contextlib.suppress(FileNotFoundError):
        return (home / LOCAL_TOKEN_FILE).read_text().strip()
    return None


def ensure_local_admin(home: Path, person: str) -> Identity:
    """The local stack is one command for one person: `up` gives the local user an admin token
    in the state folder (mode 0600), once; a token there that still works is kept."""
    store = TokenStore(home)
    path = home / LOCAL_TOKEN_FILE
    with contextlib.suppress(FileNotFoundError, TokenError):
        found = store.authenticate(path.read_text())
        if found.is_admin:
            return found
    token, _ = store.create(person, ["admin"], created_by="forgeline up", note="local stack")
    write_private(path, f"{token}\n".encode())
    return store.authenticate(token)
