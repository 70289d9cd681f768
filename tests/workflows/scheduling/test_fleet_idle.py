"""The simulator's idle ledger: free GPUs after each pass, by why, held until the next pass."""

from __future__ import annotations

import pytest

from tests.workflows.scheduling.policy_fixtures import NOW, node, request, running
from tests.workflows.scheduling.test_fleet_sim import small
from workflows.contracts.cluster_models import ClusterConfig, ClusterState, Health, Reservation
from workflows.scheduling.fleet.engine import simulate
from workflows.scheduling.fleet.idle import CAUSES, IdleLedger
from workflows.scheduling.fleet.report import report
from workflows.scheduling.fleet.workload import jobs, outages


def test_free_gpus_are_charged_to_their_cause_until_the_next_pass() -> None:
    state = ClusterState(config=ClusterConfig(), nodes=[node(f"n{i}") for i in range(5)])
    running(state, "x", ["n0"], gpus_per_node=6)  # 2 free
    state.nodes[1].spare = True
    state.reservations = [Reservation(run_id="big", nodes=["n2"], start=NOW)]
    state.nodes[3].health = Health.DOWN  # not healthy: nobody's idle time
    ledger = IdleLedger(measured_from_s=100.0)

    ledger.after_pass(state, now_s=50.0)  # nothing queued; half of it is before the window
    state.queue = [request("waits", nodes=4)]
    ledger.after_pass(state, now_s=150.0)
    ledger.until(160.0)
    assert ledger.gpu_s == {
        "nothing queued": (2 + 8) * 50.0,  # n0's 2 and n4's 8, from 100 to 150
        "reserved": 8 * 60.0,
        "spare": 8 * 60.0,
        "other": (2 + 8) * 10.0,  # the same GPUs once a request waits
    }


def test_the_causes_and_allocation_never_add_up_to_more_than_the_fleet() -> None:
    config = small(days=2)
    figures = report(simulate(config, jobs(config), outages(config), None))
    assert set(figures.idle) == set(CAUSES)
    assert all(share >= 0 for share in figures.idle.values())
    assert figures.idle["spare"] > 0  # two spare nodes, idle while no gang fails
    assert figures.allocation + sum(figures.idle.values()) <= 1 + 1e-9
    assert figures.allocation + sum(figures.idle.values()) == pytest.approx(1, abs=0.05)
