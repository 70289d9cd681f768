"""The spare pool on the real stack: `forgeline up --spares N` holds healthy idle nodes back
from the queue, and a gang recovering from a dead node takes one at once, ahead of the runs
waiting in line."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tests.e2e.conftest import Stack, variant, wait_for
from tests.e2e.faults import gang_of, kill_a_node_of
from workflows.contracts.api_models import RunView
from workflows.contracts.cluster_models import ClusterState, Health
from workflows.contracts.models import Phase, RunStatus

pytestmark = pytest.mark.e2e


def cluster(stack: Stack) -> ClusterState:
    return ClusterState.model_validate_json(stack.cli("nodes", "--json").stdout)


def status(stack: Stack, run: str) -> RunStatus:
    return RunView.model_validate_json(stack.cli("status", run, "--json").stdout).status


def the_spare(stack: Stack) -> str | None:
    spares = [n.info.node_id for n in cluster(stack).nodes if n.spare]
    return spares[0] if len(spares) == 1 else None


# Slow: a three-node run, a SIGKILL and a recovery on the stack (about 100 s). In make test: the
# Cluster workflow granting a release that requeues its survivors and the spare ahead of the
# queue (tests/workflows/test_cluster_requeue.py), and a recovery on the spare from the
# TrainingRun workflow (tests/workflows/test_dead_node.py).
@pytest.mark.slow
def test_a_recovering_gang_takes_the_spare_ahead_of_the_queue(stack: Stack, tmp_path: Path) -> None:
    up = stack.cli("up", "--nodes", "3", "--spares", "1")
    assert "1 healthy idle node(s) held back for recovering gangs" in up.stdout, up.stdout
    big = variant(tmp_path, "spares-big", steps=300, checkpoint_every=50, nodes=3, batch_size=18,
                  heartbeat_timeout_s=5)  # fmt: skip
    queued = variant(tmp_path, "spares-queued", steps=20, nodes=1)
    try:
        spare = wait_for(lambda: the_spare(stack), 30, "one node held as the spare")
        stack.cli("run", str(big), "--detach")
        generation, first = wait_for(
            lambda: (g := gang_of(stack, "spares-big"))[0] and g, 120, "the big gang"
        )
        assert spare not in first and len(first) == 3, (spare, first)
        # Every other node is busy: the one-node run waits, and is not given the spare.
        stack.cli("run", str(queued), "--detach")
        wait_for(lambda: status(stack, "spares-queued").phase == Phase.QUEUED, 120, "a queued run")
        assert the_spare(stack) == spare

        killed = kill_a_node_of(stack, "spares-big", 0, random.Random(3))
        assert killed == generation
        later, second = wait_for(
            lambda: (g := gang_of(stack, "spares-big"))[0] > generation and g, 60, "a new gang"
        )
        # The survivors and the spare, granted before the run waiting in line.
        dead = set(first) - set(second)
        assert spare in second and len(dead) == 1, (first, second, spare)
        assert status(stack, "spares-queued").phase == Phase.QUEUED
        state = cluster(stack)
        (down,) = [n for n in state.nodes if n.info.node_id in dead]
        assert down.health == Health.DOWN, down

        stack.cli("up", "--nodes", "3", "--spares", "1")  # the dead node's agent comes back
        followed = stack.cli("run", str(big), timeout=300)
        assert "AWAITING_APPROVAL" in followed.stdout, followed.stdout
        assert status(stack, "spares-big").generation == later
    finally:
        stack.cli("cancel", "spares-queued", check=False)
        stack.cli("cancel", "spares-big", check=False)
        # The later tests get the stack without a pool (its fourth agent stays, idle).
        stack.cli("up", "--nodes", "3", "--spares", "0")
