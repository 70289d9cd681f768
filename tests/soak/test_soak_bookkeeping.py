"""The soak's own bookkeeping: its two clocks (its events count seconds from its start, and a
fault's recovery is read against the runs' own records, in epoch seconds, as the record's epoch
plus those seconds), and what it notes of a gang that waited with nodes free."""

from __future__ import annotations

import time
from pathlib import Path

from bench.local_stack import LocalStack
from bench.soak import Soak
from bench.soak_plan import SoakPlan, SoakRecord
from tests.workflows.scheduling.policy_fixtures import NOW, node, request, running
from workflows.contracts.cluster_models import ClusterState, Preemption


def test_an_event_s_epoch_is_when_it_was_noted(tmp_path: Path) -> None:
    """The record was made before the soak's clock started (run_soak applies the cluster's
    queues in between, seconds of CLI): its epoch moved every fault that much earlier, and
    every recovery came out that much longer."""
    plan = SoakPlan(seed=1, duration_s=60, mean_interval_s=20, outage_s=10, steps=10,
                    checkpoint_every=5, nodes=2, faults=[])  # fmt: skip
    record = SoakRecord(plan=plan, started_epoch=time.time() - 3.0)
    soak = Soak(LocalStack(tmp_path, {}), plan, record)
    time.sleep(0.2)
    soak.note("kill-agent", "node-0")
    noted_at = record.started_epoch + record.events[-1].at_s
    assert abs(noted_at - time.time()) < 0.1, noted_at - time.time()


def test_a_gang_that_waits_with_nodes_free_says_what_the_cluster_said_while_it_waited(
    tmp_path: Path,
) -> None:
    """The scheduler gives no waiting reason for a run it reclaims nodes for: a node-deaths
    soak saw two runs wait 26 and 32 s with nodes free, and recorded an empty reason. The note
    now says what the cluster's state held while the run waited (read then: when the wait ends
    the preemption is over and the run no longer queued)."""
    plan = SoakPlan(seed=1, duration_s=60, mean_interval_s=20, outage_s=10, steps=10,
                    checkpoint_every=5, nodes=4, faults=[])  # fmt: skip
    soak = Soak(LocalStack(tmp_path, {}), plan, SoakRecord(plan=plan))
    state = ClusterState(nodes=[node(f"node-{i}", gpus=1) for i in range(4)])
    victim = running(state, "soak-vision-01", ["node-0", "node-1"], gpus_per_node=1)
    victim.preempting = Preemption(for_run="soak-nlp-02", reason="reclaim", deadline=NOW)
    state.queue = [request("soak-nlp-02", nodes=2, gpus_per_node=1, avoid=["node-3"])]
    soak.watch(state)  # node-2 and node-3 are free: it waits with enough nodes free
    soak.waiting_free_since["soak-nlp-02"] -= 11  # as if 11 s had passed
    state.queue = []  # granted
    soak.watch(state)
    assert [(e.what, e.target) for e in soak.record.events] == [("waited-free", "soak-nlp-02")]
    assert soak.record.events[0].detail.endswith(
        "s: no reason given; preempting soak-vision-01 for it; free node-2, node-3 now; "
        "avoids node-3"
    )
