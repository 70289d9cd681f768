"""The cluster page's data (worker/fleet_view.py): what the page draws, made on the server from
the cluster state and the runs' views."""

from __future__ import annotations

from pathlib import Path

from infra.settings import Settings
from tests.worker.test_fleet_metrics import NOW, a_fleet
from worker.fleet_view import fleet_view
from workflows.contracts.cluster_models import Waiting

SETTINGS = Settings(
    home=Path("/nonexistent"), temporal_ui_url="http://ui:8233/", mlflow_uri="http://mlflow:5000"
)


def test_nodes_queue_gangs_and_runs_as_the_page_shows_them() -> None:
    state, runs = a_fleet()
    state.waiting = [Waiting(run_id="vit", position=0, reason="needs 2 nodes; 1 is free")]
    runs[0].status.mlflow_run_id = "abc123"
    view = fleet_view(state, runs, SETTINGS, NOW)

    assert [(n.node, n.state, n.gpus_used, n.runs, n.reason) for n in view.nodes] == [
        ("n1", "allocated", 2, ["gpt"], None),
        ("n2", "idle", 0, [], None),
        ("n3", "down", 0, [], "ECC errors"),  # no down_reason: the health check's
    ]
    (waiting,) = view.queue
    assert (waiting.run, waiting.team, waiting.gpus, waiting.position) == ("vit", "vision", 4, 0)
    assert waiting.waited_s == 90 and waiting.reason == "needs 2 nodes; 1 is free"
    (gang,) = view.gangs
    assert (gang.run, gang.nodes, gang.gpus, gang.phase) == ("gpt", ["n1"], 2, "TRAINING")
    assert (gang.step, gang.total_steps, gang.goodput) == (230, 400, 0.8)
    assert (gang.checkpoint_step, gang.checkpoint_age_s) == (200, 75)
    (run,) = view.runs
    assert run.temporal_url == "http://ui:8233/namespaces/default/workflows/gpt"
    assert run.mlflow_url == "http://mlflow:5000/#/runs/abc123"
    assert (run.step, run.tokens_per_s, run.goodput) == (230, 5_000, 0.8)


def test_a_request_no_pass_has_looked_at_yet_says_so() -> None:
    state, runs = a_fleet()
    (waiting,) = fleet_view(state, runs, SETTINGS, NOW).queue
    assert waiting.position is None and "not yet looked at" in waiting.reason
