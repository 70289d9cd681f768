"""The hot pool in the Cluster workflow, on the dev server: a fine-tune's request counts for its
base model, and after the pass the idle node is told to fetch it (`warm_cache` on that node's
task queue, a stand-in for the agent that joins again holding it, as the agent does). The real
activity on real agents: tests/e2e/test_hot_pool.py."""

from __future__ import annotations

import os
from pathlib import Path

from temporalio import activity
from temporalio.worker import Worker

from tests.workflows.replaying import write_history
from tests.workflows.test_cluster_workflow import Harness, node, run_scenario
from tests.workflows.test_training_run_history import RECORD_TO
from workflows.cluster import ClusterWorkflow
from workflows.contracts.cluster_models import ClusterConfig, JoinRequest, WarmInput
from workflows.contracts.held_items import checkpoint_item
from workflows.contracts.names import CLUSTER_WORKFLOW_ID, node_task_queue

LABEL = "2026-12-06-hot-pool"
BASE = "runs/base/checkpoints/step-100/MANIFEST.json"
SIZE = 7 * 10**9


def test_an_idle_node_is_told_to_fetch_the_base_model_a_fine_tune_asked_for(
    temporal_address: str, task_queue: str
) -> None:
    item = checkpoint_item(BASE)
    # Node ids of this test alone: each node's task queue is named after it.
    n0, n1 = (f"{task_queue[-12:]}-{i}" for i in (0, 1))
    asked: list[WarmInput] = []

    async def scenario(h: Harness) -> None:
        @activity.defn(name="warm_cache")
        async def warm_cache(inp: WarmInput) -> int:
            asked.append(inp)
            joined = node(n1).model_copy(update={"held": {item: SIZE}})
            await h.cluster.execute_update(ClusterWorkflow.join_node, JoinRequest(info=joined))
            return SIZE

        await h.cluster.execute_update(ClusterWorkflow.apply_config, ClusterConfig(hot_fraction=1))
        for name in (n0, n1):
            await h.cluster.signal(ClusterWorkflow.register_node, node(name))
        async with Worker(
            h.client, task_queue=node_task_queue(n1), activities=[warm_cache]
        ):  # the agent of n1
            fine_tune = await h.hold("ft", base_model=BASE, needs={item: SIZE})
            (grant,) = await h.grants(fine_tune, 1)
            assert [n.node_id for n in grant.nodes] == [n0]  # by id: nobody holds it yet
            state = await h.state(lambda s: item in s.node(n1).info.held and not s.warming)
        assert [(w.manifest_key, w.hot) for w in asked] == [(BASE, [item])]
        assert state.demand[item].weight == 1 and state.demand[item].bytes == SIZE
        assert state.node(n1).info.held == {item: SIZE}
        if record := os.environ.get(RECORD_TO):
            write_history(
                await h.cluster.fetch_history(),
                Path(record) / f"{LABEL}_Cluster_{CLUSTER_WORKFLOW_ID}",
            )

    run_scenario(temporal_address, task_queue, scenario)
