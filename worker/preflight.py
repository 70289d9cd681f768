"""Before a process for a real host starts: is every setting it needs given, and does each
service answer? One line names the first that is not, and how to fix it; a worker that started
anyway would only log connection errors until someone looked."""

from __future__ import annotations

import os
import urllib.error
import urllib.request

from temporalio.client import Client
from temporalio.runtime import Runtime

from infra.errors import InfraError
from infra.settings import Settings, setting_label, unset_settings
from worker.cli_common import CliError, ExitCode, get_client

TEMPORAL, STORE, MLFLOW = "temporal_address", "store_url", "mlflow_uri"
# What each process talks to: an agent ships metrics to MLflow, a data worker does not.
NEEDS = {
    "agent": [TEMPORAL, STORE, MLFLOW],
    "control": [TEMPORAL, STORE, MLFLOW],
    "data worker": [TEMPORAL, STORE],
}


def require_settings(process: str) -> None:
    """Each setting the process needs is set (the environment, or `forgeline up`'s record)."""
    missing = unset_settings(NEEDS[process])
    if missing:
        labels = ", ".join(setting_label(name) for name in missing)
        raise CliError(
            f"forgeline {process}: {labels} not set: set them (or the matching --options) to "
            "your Temporal, store and MLflow; on this machine's local stack, `forgeline up`"
        )


def check_store(settings: Settings) -> None:
    try:
        settings.open_store().list("runs/")
    except InfraError as err:  # the store's own message names the bucket and the fix
        raise CliError(f"the store {settings.store} cannot be used: {err}", ExitCode.DOWN) from None


def check_mlflow(settings: Settings) -> None:
    url = f"{settings.mlflow_uri.rstrip('/')}/health"
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            if 200 <= response.status < 300:
                return
            reason = f"HTTP {response.status}"
    except urllib.error.HTTPError as err:
        reason = f"HTTP {err.code}"
    except OSError as err:
        reason = str(getattr(err, "reason", None) or err)
    raise CliError(
        f"MLflow at {settings.mlflow_uri} does not answer ({reason}): check "
        f"{setting_label(MLFLOW)} and that the server is up",
        ExitCode.DOWN,
    )


async def reach_temporal(settings: Settings, runtime: Runtime | None = None) -> Client:
    fix = f"check {setting_label(TEMPORAL)}, the namespace and the TLS settings"
    return await get_client(settings, fix, runtime)


def preflight(process: str, settings: Settings) -> None:
    """The checks that need no event loop (Temporal's is `reach_temporal`, in the process's
    own loop: the client's core runtime must not hop between loops)."""
    if STORE in NEEDS[process]:
        check_store(settings)
    if MLFLOW in NEEDS[process]:
        check_mlflow(settings)


def apply_overrides(overrides: dict[str, str | None]) -> None:
    """Options given on the command line win over the environment, and reach the processes
    this one starts (torchrun and its ranks read the store's URL from the job, not from here)."""
    for variable, value in overrides.items():
        if value:
            os.environ[variable] = value
