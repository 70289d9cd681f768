"""`forgeline cluster`'s jobs table says which gangs run on lent, reserved nodes."""

from __future__ import annotations

from rich.console import Console

from tests.workflows.scheduling.policy_fixtures import node, running
from worker.cluster_render import jobs_table
from workflows.contracts.cluster_models import ClusterConfig, ClusterState


def test_a_yielder_is_shown_with_the_run_it_leaves_for() -> None:
    state = ClusterState(config=ClusterConfig(), nodes=[node("n0"), node("n1")])
    running(state, "filler", ["n0"], yields_to="big")
    running(state, "plain", ["n1"])
    console = Console(record=True, width=200)
    console.print(jobs_table(state))
    lines = {line.split("│")[1].strip(): line for line in console.export_text().splitlines()
             if line.count("│") > 2}  # fmt: skip
    assert "lent: leaves when big can start" in lines["filler"]
    assert "lent" not in lines["plain"]
