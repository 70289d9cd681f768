"""The environment of the processes a node agent starts for ranks (torchrun, its standby, the
ranks): the agent's own, less the secrets only the agent may hold."""

from __future__ import annotations

from collections.abc import Mapping

from infra.redact import API_KEY_ENV, API_KEY_FILE_ENV

# What the agent holds for itself: its Temporal key and certificate, its MLflow login, a
# person's API token. A rank (and the user's script in it) needs none of them: it reads the
# store (the AWS_* it keeps), reports to its agent through files, and talks to nobody else.
AGENT_ONLY_ENV = frozenset({
    API_KEY_ENV, API_KEY_FILE_ENV, "FORGELINE_TEMPORAL_TLS_KEY", "FORGELINE_TEMPORAL_TLS_CERT",
    "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN",
    "FORGELINE_TOKEN",
})  # fmt: skip


def rank_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The agent's environment less what only the agent may hold (AGENT_ONLY_ENV)."""
    return {name: value for name, value in environ.items() if name not in AGENT_ONLY_ENV}
