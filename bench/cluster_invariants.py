"""What must hold in every state of the Cluster workflow, whatever the load or the faults: the
benchmarks that drive the local stack read the state (GET /v1/cluster) again and again and
check each with `booking_violations`."""

from __future__ import annotations

from collections import Counter

from workflows.contracts.cluster_models import ClusterState


def booking_violations(state: ClusterState) -> list[str]:
    """Each way this state books a node or a run twice: a node holding more GPUs than it has,
    a node held by a run whose gang does not list it, a gang listing a node twice, a run holding
    two gangs. Empty when the state is sound."""
    found: list[str] = []
    listed: dict[str, set[str]] = {}
    for allocation in state.allocations:
        nodes = [n.node_id for n in allocation.nodes]
        if len(set(nodes)) < len(nodes) or listed.get(allocation.run_id, set()) & set(nodes):
            found.append(f"{allocation.run_id} lists a node twice")
        listed.setdefault(allocation.run_id, set()).update(nodes)
    runs = Counter(a.run_id for a in state.allocations)
    found += [f"{run} holds {n} gangs" for run, n in runs.items() if n > 1]
    for node in state.nodes:
        if sum(node.jobs.values()) > node.info.gpus:
            found.append(f"{node.info.node_id} double-booked: {node.jobs}")
        found += [
            f"{node.info.node_id} held by {run}, not in its gang"
            for run in node.jobs
            if node.info.node_id not in listed.get(run, set())
        ]
    return found
