"""The peer tier end to end: a two-node run takes a peer checkpoint every 10 steps and a store
checkpoint every 100; a node agent SIGKILLed between two store checkpoints costs the steps since
the last peer checkpoint, not those since the store's, and the run ends with the weights of a
run that never failed."""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest
import torch

from tests.e2e.conftest import Stack, final_weights, progress_events, variant
from tests.e2e.faults import kill_a_node_of, latest_step
from trainer.manifest import find_latest

pytestmark = pytest.mark.e2e

PEER_EVERY = 10


def peer_commit_past_100(stack: Stack, run: str, generation: int) -> int | None:
    """The first peer checkpoint `generation` committed after the store's at step 100."""
    return min(
        (e["step"] for e in progress_events(stack, run, generation)
         if e["event"] == "peer_checkpoint" and e["manifest_key"] and e["step"] > 100),
        default=None,
    )  # fmt: skip


# Slow: a 300-step run with a SIGKILL and a recovery (about 90 s). In make test: the tier's
# save, exchange, restore and fallbacks with real gloo processes (tests/trainer/test_peer_tier.py)
# and the choice of the tier (tests/activities/test_latest_checkpoint.py).
@pytest.mark.slow
def test_a_dead_node_costs_the_steps_since_the_last_peer_checkpoint(
    stack: Stack, reference: str, tmp_path: Path
) -> None:
    spec = variant(tmp_path, "peer-kill", steps=300, checkpoint_every=100, peer_every=PEER_EVERY,
                   heartbeat_timeout_s=5)  # fmt: skip
    stack.cli("run", str(spec), "--detach")
    # Killed 5 to 40 steps after its first peer checkpoint past the store's (step 100).
    killed = kill_a_node_of(stack, "peer-kill", 0, random.Random(4), peer_commit_past_100)
    trained = latest_step(stack, "peer-kill", killed)
    peer_commits = [e["step"] for e in progress_events(stack, "peer-kill", killed)
                    if e["event"] == "peer_checkpoint" and e["manifest_key"]]  # fmt: skip
    stack.cli("up", "--nodes", "3")  # the node is repaired and comes back

    followed = stack.cli("run", str(spec), timeout=300)
    assert "AWAITING_APPROVAL" in followed.stdout, followed.stdout
    events = progress_events(stack, "peer-kill", killed + 1)
    resumed = min(e["step"] for e in events if e["event"] == "started")
    # The newest peer checkpoint committed before the kill (or one that committed as the node
    # died, before its ranks reported it): the steps lost are those since.
    assert resumed % PEER_EVERY == 0 and max(peer_commits) <= resumed <= trained, (
        resumed, peer_commits, trained,
    )  # fmt: skip
    print(f"killed at step {trained}, resumed from the peer tier at {resumed}")
    logs = "\n".join(
        path.read_text(errors="replace")
        for path in (stack.home / "nodes").glob(f"*/runs/peer-kill/gen-{killed + 1}/rank-*.log")
    )
    # Every rank of the new gang, the fresh node's too (its files sent by the survivor).
    assert len(re.findall(rf"resuming from the peer tier at step {resumed}\b", logs)) == 2, logs

    final = find_latest(stack.store(), "peer-kill", max_generation=10**9)
    expected = find_latest(stack.store(), reference, max_generation=10**9)
    assert final is not None and expected is not None
    assert final.manifest.loss_history == expected.manifest.loss_history
    weights = final_weights(stack, "peer-kill", tmp_path)
    theirs = final_weights(stack, reference, tmp_path)
    assert weights.keys() == theirs.keys()
    assert all(torch.equal(weights[k], theirs[k]) for k in theirs)
    # Only the newest peer manifest stays; the store holds no peer shard.
    assert len(stack.store().list("runs/peer-kill/peer/")) == 1
