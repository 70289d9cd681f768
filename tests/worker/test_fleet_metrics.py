"""The fleet's Prometheus metrics (worker/fleet_metrics.py), read back with Prometheus' own
text parser: every value is the one the cluster state or the run's status holds."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from infra.replication import Replicated, ReplicationStatus
from tests.prometheus_text import Samples, samples
from tests.prometheus_text import value as _one
from worker.fleet_metrics import NODE_STATES, TwinReading, exposition
from workflows.contracts.api_models import RunView
from workflows.contracts.cluster_models import (
    Allocation,
    ClusterConfig,
    ClusterState,
    GangRequest,
    Health,
    Node,
    NodeInfo,
    QueueConfig,
)
from workflows.contracts.models import CheckpointRef, Goodput, Phase, RunStatus, TrainProgress

NOW = datetime(2026, 12, 5, 12, 0, tzinfo=UTC)


def _node(node_id: str, **fields: object) -> Node:
    info = NodeInfo(node_id=node_id, gpus=2, pod="pod-a", rdzv_port=29_500, incarnation="x")
    return Node(info=info, **fields)  # type: ignore[arg-type]


def a_fleet() -> tuple[ClusterState, list[RunView]]:
    busy, idle = _node("n1", jobs={"gpt": 2}), _node("n2")
    down = _node("n3", health=Health.DOWN, health_reason="ECC errors")
    gang = Allocation(
        run_id="gpt", generation=3, nodes=[busy.info], gpus_per_node=2, team="research",
        last_checkpoint_at=NOW - timedelta(seconds=75),
    )  # fmt: skip
    queued = GangRequest(
        run_id="vit", nodes=2, gpus_per_node=2, team="vision",
        submitted_at=NOW - timedelta(hours=3), waiting_since=NOW - timedelta(seconds=90),
    )  # fmt: skip
    config = ClusterConfig(queues=[QueueConfig(name="research", guaranteed_gpus=2, max_gpus=4)])
    state = ClusterState(
        config=config, nodes=[busy, idle, down], queue=[queued], allocations=[gang]
    )
    status = RunStatus(
        name="gpt", phase=Phase.TRAINING, owner="alice", team="research", total_steps=400,
        attempts=3, failures_total=1, preemptions_total=1,
        last_checkpoint=CheckpointRef(manifest_key="k", step=200, generation=3, tokens_seen=1),
        goodput=Goodput(gpu_s=100.0, allocated_gpu_s=90.0, productive_gpu_s=80.0,
                        lost_gpu_s={"queue": 10.0, "checkpoint stall": 4.0}, attempts=3),
    )  # fmt: skip
    beat = TrainProgress(node_id="n1", generation=3, step=230, tokens_per_s=5_000.0, mfu=0.41)
    return state, [RunView(status=status, progress=beat)]


def _scrape(state: ClusterState, runs: list[RunView]) -> Samples:
    return samples(exposition(state, runs, NOW).decode())


def test_nodes_teams_and_a_training_run_read_as_the_state_holds_them() -> None:
    scraped = _scrape(*a_fleet())
    where = {"pod": "pod-a"}
    for node, now_in in (("n1", "allocated"), ("n2", "idle"), ("n3", "down")):
        for word in NODE_STATES:
            value = _one(scraped, "forgeline_node_state", node=node, state=word, **where)
            assert value == (1.0 if word == now_in else 0.0), (node, word)
    assert _one(scraped, "forgeline_node_gpus_used", node="n1", **where) == 2
    assert _one(scraped, "forgeline_node_health_check_failing", node="n3", **where) == 1
    assert _one(scraped, "forgeline_node_health_check_failing", node="n2", **where) == 0

    # vision waits (since it was queued again, not since its first submission); research runs.
    assert _one(scraped, "forgeline_queue_requests", team="vision") == 1
    assert _one(scraped, "forgeline_queue_oldest_wait_seconds", team="vision") == 90
    assert _one(scraped, "forgeline_queue_requests", team="research") == 0
    assert _one(scraped, "forgeline_team_gpus_in_use", team="research") == 2
    assert _one(scraped, "forgeline_team_gpus_guaranteed", team="research") == 2
    assert _one(scraped, "forgeline_team_gpus_max", team="research") == 4
    assert ("forgeline_team_gpus_max", frozenset({("team", "vision")})) not in scraped

    run = {"run": "gpt"}
    assert _one(scraped, "forgeline_run_phase", phase="TRAINING", **run) == 1
    assert _one(scraped, "forgeline_run_phase", phase="QUEUED", **run) == 0
    assert _one(scraped, "forgeline_run_info", owner="alice", team="research", **run) == 1
    assert _one(scraped, "forgeline_run_step", **run) == 230  # the heartbeat's, not the save's
    assert _one(scraped, "forgeline_run_checkpoint_step", **run) == 200
    assert _one(scraped, "forgeline_run_checkpoint_age_seconds", **run) == 75
    assert _one(scraped, "forgeline_run_tokens_per_second", **run) == 5_000
    assert _one(scraped, "forgeline_run_mfu_ratio", **run) == 0.41
    assert _one(scraped, "forgeline_run_goodput_ratio", **run) == 0.8
    assert _one(scraped, "forgeline_run_lost_gpu_seconds", cause="checkpoint stall", **run) == 4
    assert _one(scraped, "forgeline_run_lost_gpu_seconds", cause="failure detection", **run) == 0
    assert _one(scraped, "forgeline_run_restarts_total", **run) == 2
    assert _one(scraped, "forgeline_run_failures_total", **run) == 1
    assert _one(scraped, "forgeline_run_preemptions_total", **run) == 1


def test_a_run_between_gangs_reports_its_checkpoint_step_and_no_age() -> None:
    state, runs = a_fleet()
    state.allocations.clear()
    runs[0].progress = None
    runs[0].status.phase = Phase.RECOVERING
    scraped = _scrape(state, runs)
    assert _one(scraped, "forgeline_run_step", run="gpt") == 200
    assert not [key for key in scraped if key[0] == "forgeline_run_checkpoint_age_seconds"]
    assert not [key for key in scraped if key[0] == "forgeline_run_tokens_per_second"]


def test_no_label_holds_a_step_or_a_generation() -> None:
    """Labels stay bounded: what grows with training is only ever a value."""
    state, runs = a_fleet()
    bounded = {"node", "pod", "state", "team", "run", "phase", "owner", "cause"}
    for name, labels in _scrape(state, runs):
        assert {key for key, _ in labels} <= bounded, name


def a_twin() -> TwinReading:
    """The replicator's status as it wrote it 30 s ago: two units pending, the newest copied
    4.5 s after its commit."""
    copied = Replicated("runs/gpt/checkpoints/step-200/MANIFEST.json", "", "", 4.5, 3, 100)
    status = ReplicationStatus(
        primary="s3://a", twin="s3://b", updated_at=(NOW - timedelta(seconds=30)).isoformat(),
        pending=["x", "y"], recent=[copied],
    )  # fmt: skip
    return TwinReading(status)


def test_the_twin_site_s_replication_from_the_status_the_replicator_wrote() -> None:
    state, runs = a_fleet()
    scraped = samples(exposition(state, runs, NOW, a_twin()).decode())
    assert _one(scraped, "forgeline_replication_status_readable") == 1
    assert _one(scraped, "forgeline_replication_status_age_seconds") == 30
    assert _one(scraped, "forgeline_replication_pending") == 2
    assert _one(scraped, "forgeline_replication_lag_seconds") == 4.5
    assert _one(scraped, "forgeline_replication_primary_reachable") == 1
    unreadable = samples(exposition(state, runs, NOW, TwinReading(None)).decode())
    assert _one(unreadable, "forgeline_replication_status_readable") == 0
    assert not [k for k in unreadable if k[0] == "forgeline_replication_pending"]
    no_twin = samples(exposition(state, runs, NOW).decode())
    assert not [k for k in no_twin if k[0].startswith("forgeline_replication")]
