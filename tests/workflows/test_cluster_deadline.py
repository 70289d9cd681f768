"""The start deadline in the Cluster workflow: a gang that never ran takes its reserved nodes
back from a gang whose declared max runtime would hold them far longer. On the time-skipping
test server, so that the deadline and the grace run out in milliseconds."""

from __future__ import annotations

import os
import re
from pathlib import Path

from temporalio.testing import WorkflowEnvironment

from tests.workflows.gang_holder import GangHolder
from tests.workflows.replaying import write_history
from tests.workflows.test_cluster_workflow import Harness, node, run_time_skipping
from tests.workflows.test_training_run_history import RECORD_TO
from workflows.cluster import ClusterWorkflow
from workflows.cluster_models import Allocation, ClusterConfig
from workflows.names import CLUSTER_WORKFLOW_ID

LABEL = "2026-12-04-deadline"
RESERVE_AFTER_S = 600
START_WITHIN_S = 1_200
TICK_S = 61  # the workflow passes at least once a minute while anything waits


def test_a_gang_that_never_ran_takes_its_reserved_nodes_back_at_its_deadline(
    task_queue: str,
) -> None:
    async def scenario(env: WorkflowEnvironment, h: Harness) -> None:
        config = ClusterConfig(
            reserve_after_s=RESERVE_AFTER_S, start_within_s=START_WITHIN_S, preemption_grace_s=60
        )
        await h.cluster.execute_update(ClusterWorkflow.apply_config, config)
        for n in ("n0", "n1"):
            await h.cluster.signal(ClusterWorkflow.register_node, node(n))
        long_run = await h.hold("long-run", nodes=2, max_runtime_s=10 * 3600)
        (taken,) = await h.grants(long_run, 1)
        await long_run.signal(GangHolder.release_when_preempted)
        waiting = await h.hold("waiting-run", nodes=2)
        await env.sleep(START_WITHIN_S - TICK_S)  # before its deadline: it waits, nothing stops
        assert await waiting.query(GangHolder.grants, result_type=list[Allocation]) == []
        state = await h.state()
        (held,) = state.reservations
        assert held.run_id == "waiting-run" and sorted(held.nodes) == ["n0", "n1"]

        await env.sleep(2 * TICK_S)  # past the deadline: one pass at least
        (notice,) = await h.notices(long_run, 1)
        assert notice.generation == taken.generation
        assert re.fullmatch(
            r"holds nodes reserved for waiting-run, waiting 2[01] min", notice.reason
        )
        (grant,) = await h.grants(waiting, 1)
        assert sorted(n.node_id for n in grant.nodes) == ["n0", "n1"]
        if record := os.environ.get(RECORD_TO):
            write_history(
                await h.cluster.fetch_history(),
                Path(record) / f"{LABEL}_Cluster_{CLUSTER_WORKFLOW_ID}",
            )

    run_time_skipping(task_queue, scenario)
