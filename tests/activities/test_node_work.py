"""A node agent older than its control plane (a rolling upgrade done in the wrong order): the
work it cannot read is refused naming the fields, the version and the fix, and the node's own
check fails with it, so the run goes on elsewhere and the node stays out until its agent is
restarted on the new code. Work it can read is read as the SDK would."""

from __future__ import annotations

from pathlib import Path

import pytest
from temporalio.common import RawValue
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from activities.node_work import read_train_input
from infra import node_health
from tests.activities.test_node_health_check import train_input
from workflows.contracts.models import NodeTrainInput
from workflows.gang_outcome import NODE_UNHEALTHY

CONVERTER = pydantic_data_converter.payload_converter


def sent(work: dict | NodeTrainInput) -> RawValue:
    """The work as the control plane's workflow puts it on the wire (how the agent's worker
    hands it to `train_on_node`)."""
    return RawValue(CONVERTER.to_payloads([work])[0])


def environment() -> ActivityEnvironment:
    env = ActivityEnvironment()
    env.payload_converter = CONVERTER  # the agent's worker decodes with it
    return env


def test_work_this_agent_reads_is_what_the_control_plane_sent(tmp_path: Path) -> None:
    work = train_input()
    read = environment().run(read_train_input, sent(work.model_dump(mode="json")), tmp_path)
    assert read == work
    assert node_health.failing(tmp_path) is None


def test_a_spec_field_this_agent_does_not_know_takes_its_node_out(tmp_path: Path) -> None:
    work = train_input().model_dump(mode="json")
    work["spec"]["recovery"]["drain_grace_s"] = 30  # what a newer control plane would send
    with pytest.raises(ApplicationError) as refused:
        environment().run(read_train_input, sent(work), tmp_path)
    # What the run's workflow reads as the node's own check failing: the node is reported and
    # the run moves on without it (workflows.gang_outcome), spending no user error.
    assert refused.value.type == NODE_UNHEALTHY and refused.value.non_retryable
    said = str(refused.value)
    assert "this node's agent (forgeline " in said
    assert "fields it does not know: spec.recovery.drain_grace_s" in said
    assert "Upgrade Forgeline on this host and restart its agent" in said
    assert "upgrade agents first, then the control plane" in said
    # The node stays out of service (its check fails) until a new agent starts on it.
    failing = node_health.failing(tmp_path)
    assert failing is not None and "fields it does not know" in failing
