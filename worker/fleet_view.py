"""The cluster page's data (`GET /v1/fleet`): nodes by pod and state, the queue with why each
request waits, the running gangs with their goodput and last checkpoint, and the runs with
links into the Temporal and MLflow UIs. Built from the Cluster workflow's state and the runs'
views, as `forgeline nodes`, `jobs` and `runs` are, so the page and the CLI agree; the page's
script only draws it."""

from __future__ import annotations

from datetime import datetime
from urllib.parse import quote

from infra.settings import Settings
from workflows.contracts.api_models import FleetView, GangRow, NodeRow, QueueRow, RunRow, RunView
from workflows.contracts.cluster_models import Allocation, ClusterState, GangRequest, Node


def waited_s(request: GangRequest, now: datetime) -> float:
    """Since it was queued this time (a requeued run's deadline counts from then too)."""
    since = request.waiting_since or request.submitted_at
    return max(0.0, (now - since).total_seconds()) if since is not None else 0.0


def fleet_view(
    state: ClusterState, runs: list[RunView], settings: Settings, now: datetime
) -> FleetView:
    by_name = {view.status.name: view for view in runs}
    return FleetView(
        nodes=sorted((_node(n) for n in state.nodes), key=lambda r: (r.pod, r.node)),
        queue=_queue(state, now),
        gangs=[_gang(a, by_name.get(a.run_id), now) for a in state.allocations],
        runs=[_run(view, settings) for view in runs],
        temporal_ui=settings.temporal_ui_url,
        mlflow_ui=settings.mlflow_uri,
    )


def _node(node: Node) -> NodeRow:
    return NodeRow(
        node=node.info.node_id,
        pod=node.info.pod,
        state=node.state,
        gpus=node.info.gpus,
        gpus_used=node.used,
        runs=sorted(node.jobs),
        reason=node.down_reason or node.health_reason,
    )


def _queue(state: ClusterState, now: datetime) -> list[QueueRow]:
    why = {w.run_id: w for w in state.waiting}
    rows = [
        QueueRow(
            run=request.run_id,
            team=request.team,
            nodes=request.nodes,
            gpus=request.gpus,
            position=why[request.run_id].position if request.run_id in why else None,
            waited_s=waited_s(request, now),
            reason=why[request.run_id].reason
            if request.run_id in why
            else "not yet looked at by a scheduling pass",
        )
        for request in state.queue
    ]
    return sorted(rows, key=lambda r: (r.position is None, r.position or 0, r.run))


def _gang(allocation: Allocation, view: RunView | None, now: datetime) -> GangRow:
    row = GangRow(
        run=allocation.run_id,
        team=allocation.team,
        nodes=[n.node_id for n in allocation.nodes],
        gpus=allocation.gpus,
        granted_at=allocation.granted_at,
        yields_to=allocation.yields_to,
    )
    if allocation.last_checkpoint_at is not None:
        row.checkpoint_age_s = max(0.0, (now - allocation.last_checkpoint_at).total_seconds())
    if view is not None:
        status = view.status
        row.phase, row.total_steps = status.phase.value, status.total_steps
        row.step = view.progress.step if view.progress is not None else None
        row.goodput = status.goodput.goodput if status.goodput is not None else None
        if status.last_checkpoint is not None:
            row.checkpoint_step = status.last_checkpoint.step
    return row


def _run(view: RunView, settings: Settings) -> RunRow:
    status, beat = view.status, view.progress
    workflow = f"namespaces/{quote(settings.temporal_namespace)}/workflows/{quote(status.name)}"
    return RunRow(
        name=status.name,
        phase=status.phase.value,
        owner=status.owner,
        team=status.team,
        step=view.newest_step,
        total_steps=status.total_steps,
        tokens_per_s=beat.tokens_per_s if beat is not None else None,
        goodput=status.goodput.goodput if status.goodput is not None else None,
        temporal_url=f"{settings.temporal_ui_url.rstrip('/')}/{workflow}",
        mlflow_url=(
            f"{settings.mlflow_uri.rstrip('/')}/#/runs/{status.mlflow_run_id}"
            if status.mlflow_run_id
            else None
        ),
    )
