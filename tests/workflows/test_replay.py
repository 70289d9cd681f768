"""Recorded histories of real runs replay against the current workflow code.

A change to a workflow that alters the commands it issues for an old history (another order,
another activity, one more timer) would break every run in flight when the worker is
redeployed. Such a change goes behind `workflow.patched`; these histories (recorded by
tests/workflows/record_histories.py, see histories/README.md) are the check. No server is
needed: the Replayer runs the workflow code against the events alone.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from temporalio.worker import WorkflowReplayResult

from tests.workflows.replaying import (
    HISTORIES,
    WORKFLOWS,
    history_files,
    read_history,
    replayer,
    workflow_type,
)

FILES = history_files()


@pytest.mark.parametrize("path", FILES, ids=[path.name for path in FILES])
def test_history_replays(path: Path) -> None:
    history = read_history(path)
    result: WorkflowReplayResult = asyncio.run(
        replayer().replay_workflow(history, raise_on_replay_failure=False)
    )
    if result.replay_failure is not None:
        pytest.fail(
            f"{path.name} ({workflow_type(history)}) no longer replays: "
            f"{type(result.replay_failure).__name__}: {result.replay_failure}\n"
            "a workflow change that issues other commands for old histories must go behind "
            "workflow.patched (see tests/workflows/histories/README.md)",
            pytrace=False,
        )


def test_every_workflow_type_has_a_recording() -> None:
    """The recordings cannot silently vanish, nor a workflow go unrecorded."""
    recorded = {workflow_type(read_history(path)) for path in FILES}
    missing = sorted(set(WORKFLOWS) - recorded)
    assert not missing, f"no history of {', '.join(missing)} in {HISTORIES}"
