"""A node agent with no container runtime refuses a run that names an image, at once and for
good, saying what would fix it: its ranks would otherwise run outside the image the spec
names (activities/node.py). Where a runtime is, the run goes on to its job (the container run
itself is tests/e2e/test_image.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from temporalio.exceptions import ApplicationError

from activities.node import NodeActivities
from infra.containers import ContainerRuntime
from infra.errors import ObjectNotFound
from infra.settings import load_settings
from tests.activities.test_node_health_check import train_input
from tests.activities.test_node_work import environment, sent
from workflows.contracts.models import NodeTrainInput

IMAGE = "registry.lab/team/trainer:1"


def imaged() -> NodeTrainInput:
    inp = train_input()
    train = inp.spec.train.model_copy(update={"image": IMAGE})
    return inp.model_copy(update={"spec": inp.spec.model_copy(update={"train": train})})


def test_a_node_without_a_container_runtime_refuses_an_image_for_good(tmp_path: Path) -> None:
    agent = NodeActivities(load_settings(tmp_path / "home"), "n1", container_runtime=None)
    with pytest.raises(ApplicationError) as refused:
        asyncio.run(environment().run(agent.train_on_node, sent(imaged())))
    assert refused.value.type == "NodeRefusesImage" and refused.value.non_retryable
    assert f"cannot run train.image {IMAGE!r}" in str(refused.value)
    assert "install podman" in str(refused.value)


def test_a_node_with_one_goes_on_to_the_job(tmp_path: Path) -> None:
    runtime = ContainerRuntime("podman", "4.3.1")
    agent = NodeActivities(load_settings(tmp_path / "home"), "n1", container_runtime=runtime)
    # It goes on to fetch the job's dataset, which this test's store does not hold.
    with pytest.raises(ObjectNotFound, match="store/k"):
        asyncio.run(environment().run(agent.train_on_node, sent(imaged())))
