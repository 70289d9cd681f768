"""Which nodes a finished attempt blames, and how: what the Cluster workflow is told."""

from __future__ import annotations

from datetime import UTC, datetime

from workflows.cluster_calls import nodes_at_fault
from workflows.contracts.models import Failure, HealthEvent

AT = datetime(2026, 11, 29, tzinfo=UTC)


def test_a_corruption_suspect_is_reported_for_quarantine_beside_dead_nodes() -> None:
    """A NaN that the all-reduce spread to every rank stops the gang (a failure that names no
    node); the health event names the replica it came from: that node is reported as
    corruption, which the cluster cordons (tests/workflows/test_cluster_workflow.py)."""
    failures = [
        Failure(generation=3, node_id=None, reason="non-finite loss or gradients", at=AT),
        Failure(generation=3, node_id="n2", reason="n2 died", at=AT),
    ]
    health = [
        HealthEvent(generation=3, node_id="n1", kind="corruption", evidence="rank 0 NaN"),
        HealthEvent(generation=2, node_id="n0", kind="corruption", evidence="an older gang"),
        HealthEvent(generation=3, node_id="n3", kind="straggler", evidence="3.0× slower"),
    ]
    assert nodes_at_fault(failures, health, generation=3) == [
        ("n2", "n2 died", "fail-stop"),
        ("n1", "suspected silent corruption: rank 0 NaN", "corruption"),
    ]
