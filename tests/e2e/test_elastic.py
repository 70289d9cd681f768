"""Elastic resume on the real stack: a two-node run with `resources.min_nodes = 1` loses a node
when no other is free, trains on the survivor alone, and grows back to two nodes when a node
is put back in service; its losses and final weights are those of the fixed-size reference."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from infra.store.protocol import ObjectStore
from tests.e2e.conftest import Stack, final_weights, variant, wait_for
from tests.e2e.faults import gang_of, kill_a_node_of, own_commit
from trainer.manifest import find_latest
from workflows.contracts.api_models import RunView
from workflows.contracts.cluster_models import ClusterState
from workflows.contracts.models import RunStatus

pytestmark = pytest.mark.e2e

RUN = "elastic"


def status(stack: Stack) -> RunStatus:
    return RunView.model_validate_json(stack.cli("status", RUN, "--json").stdout).status


def losses(store: ObjectStore, run: str) -> list[float]:
    final = find_latest(store, run, max_generation=10**9)
    assert final is not None
    return [loss for _, loss in final.manifest.loss_history]


# Slow: a run that shrinks and grows back on the stack (about 100 s). In make test: the policy
# that shrinks and grows gangs (tests/workflows/scheduling/test_elastic.py) and the spec that
# trains a shrunk gang's global batch (tests/worker/test_specfile.py).
@pytest.mark.slow
def test_a_run_shrinks_to_min_nodes_and_grows_back(
    stack: Stack, reference: str, tmp_path: Path
) -> None:
    spec = variant(tmp_path, RUN, steps=300, checkpoint_every=50, heartbeat_timeout_s=5)
    spec.write_text(spec.read_text().replace("[resources]\n", "[resources]\nmin_nodes = 1\n"))
    stack.cli("run", str(spec), "--detach")
    idle: list[str] = []
    try:
        _, first = wait_for(lambda: (g := gang_of(stack, RUN))[0] and g, 120, "a gang")
        assert len(first) == 2, first
        # No free node: the third is cordoned (the first gang's is taken down by the kill).
        nodes = ClusterState.model_validate_json(stack.cli("nodes", "--json").stdout).nodes
        idle = [n.info.node_id for n in nodes if n.info.node_id not in first]
        for node in idle:
            stack.cli("node", "cordon", node)

        killed = kill_a_node_of(stack, RUN, 0, random.Random(11))
        shrunk, alone = wait_for(
            lambda: (g := gang_of(stack, RUN))[0] > killed and g, 90, "the shrunk gang"
        )
        assert len(alone) == 1 and alone[0] in first, (first, alone)
        assert "elastic        on 1 of 2 nodes since a failure" in stack.cli("status", RUN).stdout
        # The single node trains and commits a checkpoint of its own before it grows back.
        wait_for(lambda: own_commit(stack, RUN, shrunk), 120, "a commit on one node")
        for node in idle:
            stack.cli("node", "undrain", node)
        grown, both = wait_for(
            lambda: (g := gang_of(stack, RUN))[0] > shrunk and g, 90, "the gang grown back"
        )
        assert len(both) == 2 and alone[0] in both, (alone, both)

        followed = stack.cli("run", str(spec), timeout=300)
        assert "AWAITING_APPROVAL" in followed.stdout, followed.stdout
        attempts = {a.generation: a for a in status(stack).gang_attempts}
        assert attempts[shrunk].gpus == 1 and attempts[shrunk].outcome == "regrown"
        assert attempts[grown].gpus == 2 and attempts[grown].after == "grow"

        # The shrunk gang trained the same global batch (more gradient accumulation). Here that
        # is exact: one rank accumulating two halved micro-batch gradients adds what two ranks'
        # halved gradients add in DDP (halving is exact in floating point), so the kept
        # lineage's losses and final weights are bitwise those of the reference run, which
        # never changed size. Other sizes sum in another order: close, not equal.
        store = stack.store()
        mine, theirs = losses(store, RUN), losses(store, reference)
        worst = max(abs(a - b) for a, b in zip(mine, theirs, strict=True))
        print(f"\nelastic vs fixed-size losses: worst step differs by {worst:.2e}")
        assert mine == theirs
        weights = final_weights(stack, RUN, tmp_path)
        expected = final_weights(stack, reference, tmp_path)
        assert weights.keys() == expected.keys()
        assert all(torch.equal(weights[k], expected[k]) for k in expected)
    finally:
        for node in idle:
            stack.cli("node", "undrain", node, check=False)
        stack.cli("cancel", RUN, check=False)
        stack.cli("up", "--nodes", "3")  # the killed node's agent comes back
