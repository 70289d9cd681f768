"""The local stack's MLflow takes writes only from Forgeline: MLflow's basic-auth app, one login.

`forgeline up` runs its MLflow server with `--app-name basic-auth`, which answers 401 to any
request without a known user. Two users exist:

- `forgeline`, MLflow's admin: what Forgeline's own processes (the workers, the agents, the API
  and the CLI of whoever owns the state folder) send. Its password lives in the state folder
  (`mlflow-login.json`, mode 0600), so whoever can read that folder is the stack's owner anyway.
- `viewer`: for people in the MLflow UI. Every user gets MLflow's default permission, READ, on
  what it did not create, so the viewer can browse runs and models but cannot move an alias,
  tag a version or delete anything of Forgeline's (403).

So nobody who merely reaches the port can point `@production` at a version, and the approval
record and file digests on each version are written by Forgeline alone. A stack whose MLflow is
external (FORGELINE_MLFLOW_URI) is the operator's to protect: nothing here applies to it.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from infra.errors import StackError
from infra.tokens import write_private

LOGIN_FILE = "mlflow-login.json"
AUTH_CONFIG = "mlflow-auth.ini"
AUTH_DB = "mlflow-auth.db"
WRITER, VIEWER = "forgeline", "viewer"
USERNAME_ENV, PASSWORD_ENV = "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"
_CREDENTIAL_ENVS = (USERNAME_ENV, PASSWORD_ENV, "MLFLOW_TRACKING_TOKEN")


class MlflowLogin(BaseModel):
    """`mlflow-login.json`: the local MLflow's address and the secrets that go with it."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    version: Literal[1] = 1
    uri: str  # the server these are for: never sent to any other
    writer_password: str = Field(repr=False)
    viewer_password: str = Field(repr=False)
    flask_secret: str = Field(repr=False)  # the auth app's CSRF key, fixed across restarts

    def server_env(self, home: Path) -> dict[str, str]:
        """What `mlflow server --app-name basic-auth` needs in its environment."""
        return {
            "MLFLOW_AUTH_CONFIG_PATH": str(home / AUTH_CONFIG),
            # Read once, when the auth database has no admin yet (the first start).
            "MLFLOW_AUTH_ADMIN_PASSWORD": self.writer_password,
            "MLFLOW_FLASK_SERVER_SECRET_KEY": self.flask_secret,
        }


def prepare(home: Path, uri: str) -> MlflowLogin:
    """The login for a local MLflow about to start at `uri`, made on the first start. Without
    a login file the users' database is dropped too: its admin's password would be lost."""
    path = home / LOGIN_FILE
    login = read(home)
    if login is None:
        (home / AUTH_DB).unlink(missing_ok=True)
        login = MlflowLogin(
            uri=uri,
            writer_password=secrets.token_urlsafe(24),
            viewer_password=secrets.token_urlsafe(12),
            flask_secret=secrets.token_urlsafe(32),
        )
    elif login.uri != uri:
        login = login.model_copy(update={"uri": uri})  # a new port: the same users
    write_private(path, login.model_dump_json(indent=2).encode())
    (home / AUTH_CONFIG).write_text(
        "[mlflow]\n"
        "default_permission = READ\n"
        f"database_uri = sqlite:///{home / AUTH_DB}\n"
        f"admin_username = {WRITER}\n"
        "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n"
        # Without a cache every request pays a PBKDF2 check; metrics stream in many requests.
        "auth_cache_ttl_seconds = 60\n"
    )
    return login


def read(home: Path) -> MlflowLogin | None:
    path = home / LOGIN_FILE
    if not path.is_file():
        return None
    try:
        return MlflowLogin.model_validate_json(path.read_text())
    except ValidationError as err:
        raise StackError(
            f"{path} is not a login this version of Forgeline wrote ({err.errors()[0]['msg']}): "
            f"stop the stack (`forgeline down`), delete it and {AUTH_DB}, and `forgeline up`"
        ) from None


def add_viewer(login: MlflowLogin, timeout_s: float = 30.0) -> None:
    """Create the read-only `viewer` user (once; it exists after a restart)."""
    import requests  # late: every `forgeline` command imports this module

    response = requests.post(
        f"{login.uri.rstrip('/')}/api/2.0/mlflow/users/create",
        json={"username": VIEWER, "password": login.viewer_password},
        auth=(WRITER, login.writer_password),
        timeout=timeout_s,
    )
    if response.ok or "RESOURCE_ALREADY_EXISTS" in response.text:
        return
    raise StackError(
        f"MLflow at {login.uri} refused to create its viewer user ({response.status_code}: "
        f"{response.text[:200]}): its users' database ({AUTH_DB}) may belong to another "
        f"login; stop the stack, delete {LOGIN_FILE} and {AUTH_DB} in the state folder, then up"
    )


def use_local_login(home: Path, mlflow_uri: str) -> None:
    """Let this process's MLflow clients sign in to the local stack's MLflow as Forgeline: only
    when `mlflow_uri` is the server the login is for, and no credentials are set already."""
    login = read(home)
    if login is None or login.uri.rstrip("/") != mlflow_uri.rstrip("/"):
        return
    if any(os.environ.get(name) for name in _CREDENTIAL_ENVS):
        return  # the caller's own (an operator's, a test's): theirs to choose
    os.environ[USERNAME_ENV] = WRITER
    os.environ[PASSWORD_ENV] = login.writer_password
