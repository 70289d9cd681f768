"""A gang recovering from a dead node gives its nodes back and queues again in one signal: the
survivors and a spare are its, not the next run's in line (the Cluster workflow on a real
Temporal dev server)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from tests.workflows.test_cluster_workflow import Harness, node, run_scenario
from workflows.cluster import ClusterWorkflow
from workflows.contracts.cluster_models import ClusterConfig, GangRequest, NodeFailure, Release


def test_a_release_that_requeues_keeps_the_survivors_from_the_queue(
    temporal_address: str, task_queue: str
) -> None:
    async def scenario(h: Harness) -> None:
        await h.cluster.execute_update(ClusterWorkflow.apply_config, ClusterConfig(spare_nodes=1))
        for n in ("n0", "n1", "n2", "n3"):
            await h.cluster.signal(ClusterWorkflow.register_node, node(n))
        submitted = datetime.now(UTC) - timedelta(minutes=5)
        big = await h.hold("run-a", nodes=3, submitted_at=submitted)
        (first,) = await h.grants(big, 1)
        (spare,) = [
            n.info.node_id for n in (await h.state(lambda s: any(n.spare for n in s.nodes))).nodes
            if n.spare
        ]  # fmt: skip
        assert spare not in {n.node_id for n in first.nodes}
        small = await h.hold("run-b", nodes=1)
        await h.state(lambda s: [r.run_id for r in s.queue] == ["run-b"])

        victim = first.nodes[0].node_id
        await h.cluster.signal(
            ClusterWorkflow.report_failure,
            NodeFailure(run_id="run-a", generation=first.generation, node_id=victim, reason="gone"),
        )
        again = GangRequest(
            run_id="run-a", nodes=3, gpus_per_node=1, recovery=True, submitted_at=submitted
        )
        await h.cluster.signal(
            ClusterWorkflow.release,
            Release(run_id="run-a", generation=first.generation, requeue=again),
        )
        second = (await h.grants(big, 2))[1]
        survivors = {n.node_id for n in first.nodes} - {victim}
        assert {n.node_id for n in second.nodes} == survivors | {spare}
        state = await h.state()
        assert [r.run_id for r in state.queue] == ["run-b"]
        assert await small.query("grants") == []

    run_scenario(temporal_address, task_queue, scenario)
