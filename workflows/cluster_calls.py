"""What a TrainingRun asks of the Cluster workflow: a gang for its spec, and reports about the
nodes it held. Called from workflow code (deterministic: times and ids come from the workflow)."""

from __future__ import annotations

from datetime import datetime

from temporalio import workflow

from workflows.contracts.cluster_models import GangRequest, NodeFailure
from workflows.contracts.models import Failure, HealthEvent
from workflows.contracts.names import CLUSTER_WORKFLOW_ID
from workflows.contracts.spec import RunSpec


def gang_request(
    spec: RunSpec,
    snapshot_id: str | None,
    recovering: bool,
    submitted_at: datetime,
    started_before: bool = False,
    needs: dict[str, int] | None = None,
    base_model: str | None = None,
    avoid: list[str] | None = None,
) -> GangRequest:
    resources = spec.resources
    return GangRequest(
        run_id=spec.name,
        nodes=resources.nodes,
        gpus_per_node=resources.gpus_per_node,
        team=resources.team,
        gpu_type=resources.gpu_type,
        priority=resources.priority,
        preemptible=resources.preemptible,
        max_runtime_s=resources.max_runtime_h * 3600 if resources.max_runtime_h else None,
        cache_items=[snapshot_id] if snapshot_id else [],
        needs=needs or {},
        base_model=base_model,
        allow_multi_pod=resources.allow_multi_pod,
        topology=resources.topology,
        topology_wait_s=(
            None if resources.topology_wait_min is None else resources.topology_wait_min * 60
        ),
        # After a failure or a swap the gang may take a spare instead of waiting.
        recovery=recovering,
        min_nodes=resources.min_nodes,
        # Requeued after a failure or a preemption, the run keeps its place by age.
        submitted_at=submitted_at,
        started_before=started_before,
        avoid=avoid or [],
        layout=spec.layout_summary(),
    )


def nodes_at_fault(
    failures: list[Failure], health: list[HealthEvent], generation: int
) -> list[tuple[str, str, str]]:
    """(node, reason, kind) for every node an attempt's failures or health checks blamed:
    dead or unhealthy ones, and those whose ranks were named as the source of silent
    corruption (quarantined: the run keeps off it, the cluster cordons it on more teams'
    word, workflows.scheduling.node_reports)."""
    reports = [(f.node_id, f.reason, f.kind) for f in failures if f.node_id]
    reports += [
        (e.node_id, f"suspected silent corruption: {e.evidence}", "corruption")
        for e in health
        if e.kind == "corruption" and e.generation == generation and e.node_id
    ]
    return reports


async def report_nodes(run_id: str, generation: int, reports: list[tuple[str, str, str]]) -> None:
    """Tell the cluster about each (node, reason, kind): it takes the node down or cordons it."""
    cluster = workflow.get_external_workflow_handle(CLUSTER_WORKFLOW_ID)
    for node_id, reason, kind in reports:
        failure = NodeFailure(
            run_id=run_id, generation=generation, node_id=node_id, reason=reason, kind=kind
        )
        await cluster.signal("report_failure", failure)
