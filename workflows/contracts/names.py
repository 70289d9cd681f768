"""Well-known workflow ids and task queues shared by workflows, workers and the CLI, and the rule
for the names people choose (runs, models, teams, owners, nodes), which become workflow ids,
store keys, folder names and MLflow model names."""

from __future__ import annotations

import re

CLUSTER_WORKFLOW_ID = "forgeline-cluster"
# Signals the Cluster workflow sends to a run.
GANG_GRANTED_SIGNAL = "gang_granted"
PREEMPT_SIGNAL = "preempt"
# Node agents tell a run what its gang's health checks found.
HEALTH_SIGNAL = "health_event"
CONTROL_TASK_QUEUE = "forgeline-control"

# One path component that is never '.', '..', hidden or a store temporary ('.tmp-…'): the first
# character is a letter or digit. Lowercase only, so two names never differ by case alone (case-
# insensitive file systems, MLflow's registry). 63 characters leave room for the suffixes added
# to make other ids (`<run>-dataset`) within the 255 of a file name.
NAME_PATTERN = r"^[a-z0-9][a-z0-9._-]{0,62}$"
NAME_RULE = "1-63 characters from a-z, 0-9, '.', '_', '-', starting with a letter or digit"
# Snapshot ids are hex digests (dataprep.plan names them); the bounds only keep them sane.
SNAPSHOT_ID_PATTERN = r"^[0-9a-f]{8,64}$"
SNAPSHOT_ID_RULE = "8-64 hex digits (0-9, a-f), as `forgeline status RUN` shows it"


class InvalidName(ValueError):
    """A user-supplied name that cannot become an id, key or path; the message says the rule."""


def is_valid_name(name: object) -> bool:
    # fullmatch, not match: with re.match, '$' also matches before a final newline, so
    # "run\n" would pass (pydantic's patterns do not have that quirk).
    return isinstance(name, str) and re.fullmatch(NAME_PATTERN, name) is not None


def check_name(name: object, what: str = "name") -> str:
    """`name` if it is a valid name, else InvalidName naming `what` and the rule."""
    if not is_valid_name(name):
        raise InvalidName(f"{what} {_quoted(name)} is not valid: use {NAME_RULE}")
    return name  # type: ignore[return-value]


def check_snapshot_id(snapshot_id: object) -> str:
    if not isinstance(snapshot_id, str) or not re.fullmatch(SNAPSHOT_ID_PATTERN, snapshot_id):
        raise InvalidName(
            f"snapshot id {_quoted(snapshot_id)} is not valid: use {SNAPSHOT_ID_RULE}"
        )
    return snapshot_id


def _quoted(value: object, limit: int = 80) -> str:
    """repr, so control characters and trailing spaces show; cut, so a megabyte stays a line."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 1]}…"


def node_task_queue(node_id: str) -> str:
    """Each node agent polls its own queue, so an activity lands on exactly that node."""
    return f"forgeline-node-{node_id}"


# Data preparation fans out here: start more data workers for more throughput.
DATA_TASK_QUEUE = "forgeline-data"


DATASET_SUFFIX = "-dataset"
# `forgeline data prepare`'s own workflows: a digest of the [data] table (worker.data_cli).
STANDALONE_DATASET_ID = re.compile(r"dataset-[0-9a-f]{16}")


def dataset_workflow_id(run_id: str) -> str:
    return f"{run_id}{DATASET_SUFFIX}"


def standalone_dataset_workflow_id(table_sha256: str) -> str:
    return f"dataset-{table_sha256[:16]}"


def reserved_id(name: str) -> str | None:
    """What else runs under workflow id `name`, if anything: a run is a workflow under its own
    name, and may not take another's (its start would attach to it, or be refused by it)."""
    if name == CLUSTER_WORKFLOW_ID:
        return "the Cluster workflow's id"
    if name.endswith(DATASET_SUFFIX):
        return f"how the id of a run's data preparation ends (RUN{DATASET_SUFFIX})"
    if STANDALONE_DATASET_ID.fullmatch(name):
        return "the form of `forgeline data prepare`'s workflow ids (dataset-<16 hex digits>)"
    return None
