"""A node whose own health check fails stops its training attempt, and the run holds the node
at fault (the end-to-end test is marked slow: tests/e2e/test_failures.py)."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest
from temporalio.exceptions import ActivityError, ApplicationError, RetryState
from temporalio.testing import ActivityEnvironment

from activities.node import NodeUnhealthy, _Reporter, as_run_errors
from infra import node_health
from trainer.errors import NodeFault, RanksFailed
from workflows.contracts.cluster_models import Allocation, NodeInfo
from workflows.contracts.models import DatasetRef, NodeTrainInput
from workflows.contracts.spec import RunSpec
from workflows.gang_outcome import NODE_UNHEALTHY, failures_of

NODES = [NodeInfo(node_id=n, rdzv_port=29500, incarnation="a") for n in ("n0", "n1")]


def train_input() -> NodeTrainInput:
    return NodeTrainInput(
        run_id="r",
        spec=RunSpec.model_validate({"name": "r", "data": {"sources": ["corpus.txt"]}}),
        dataset=DatasetRef(
            snapshot_id="s", manifest_key="k", manifest_sha256="0" * 64, vocab_size=65,
            train_tokens=1, val_tokens=1, documents=1, duplicates_removed=0,
        ),
        allocation=Allocation(run_id="r", generation=3, nodes=NODES),
        node_id="n1",
    )  # fmt: skip


def test_the_agent_stops_reporting_progress_once_its_check_fails(tmp_path: Path) -> None:
    reporter = _Reporter("n1", train_input(), tmp_path, tell_cluster=False)
    beats: list = []
    env = ActivityEnvironment()
    env.on_heartbeat = lambda *details: beats.append(details)
    env.run(reporter.progress, {"step": 5})
    assert len(beats) == 1
    (tmp_path / node_health.FAILURE_FILE).write_text("uncorrectable ECC errors\n")
    with pytest.raises(NodeUnhealthy, match="node n1: health check failed: uncorrectable ECC"):
        env.run(reporter.progress, {"step": 6})  # raised inside run_ranks: the ranks stop
    assert len(beats) == 1


class _Done:
    """What failures_of reads of an activity handle."""

    def __init__(self, err: BaseException | None) -> None:
        self._err = err

    def exception(self) -> BaseException | None:
        return self._err


def _activity_error(cause: BaseException) -> ActivityError:
    err = ActivityError(
        "activity error", scheduled_event_id=1, started_event_id=2, identity="n1",
        activity_type="train_on_node", activity_id="x",
        retry_state=RetryState.NON_RETRYABLE_FAILURE,
    )  # fmt: skip
    err.__cause__ = cause
    return err


def test_the_run_holds_the_unhealthy_node_at_fault_not_its_peers() -> None:
    unhealthy = ApplicationError("node n1: health check failed: ECC", type="NodeUnhealthy")
    broken = ApplicationError("torchrun exited with status 1", type="RanksFailed")
    allocation = Allocation(run_id="r", generation=3, nodes=NODES)
    handles = [_Done(_activity_error(broken)), _Done(_activity_error(unhealthy))]
    failures = failures_of(allocation, handles, datetime.now(UTC))  # type: ignore[arg-type]
    assert [(f.node_id, f.kind) for f in failures] == [(None, "fail-stop"), ("n1", "unhealthy")]


def test_a_node_whose_device_says_it_is_broken_fails_its_check_until_repaired(
    tmp_path: Path,
) -> None:
    """A rank's device said it is broken (trainer.platform_faults): the run is told the node is
    at fault, not that its gang crashed, and the node's check fails from then on, so it is
    given no other gang until its operator repairs it (a new agent: node_health.repaired)."""
    said = "a device of node n1 is broken: AcceleratorError: CUDA error: uncorrectable ECC error"
    with pytest.raises(ApplicationError) as raised, as_run_errors(tmp_path):
        raise NodeFault(said)
    assert raised.value.type == NODE_UNHEALTHY and raised.value.non_retryable
    allocation = Allocation(run_id="r", generation=3, nodes=NODES)
    failures = failures_of(
        allocation, [_Done(None), _Done(_activity_error(raised.value))], datetime.now(UTC)
    )  # type: ignore[list-item]
    assert [(f.node_id, f.kind) for f in failures] == [("n1", "unhealthy")]
    assert (
        node_health.failing(tmp_path)
        == f"health check failed: {said} (from {tmp_path / node_health.FAILURE_FILE})"
    )
    node_health.repaired(tmp_path)
    assert node_health.failing(tmp_path) is None


def test_a_crash_that_is_not_the_node_s_restarts_the_gang_and_leaves_the_node_in(
    tmp_path: Path,
) -> None:
    with pytest.raises(ApplicationError) as raised, as_run_errors(tmp_path):
        raise RanksFailed("a rank on node n1 failed: RuntimeError: CUDA out of memory")
    assert raised.value.type == "RanksFailed" and not raised.value.non_retryable
    assert node_health.failing(tmp_path) is None
