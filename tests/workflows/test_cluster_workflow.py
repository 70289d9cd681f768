"""The Cluster workflow against a real Temporal dev server."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import TypeVar

from temporalio.client import Client, WorkflowHandle
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.service import RPCError
from temporalio.worker import Worker

from tests.workflows.gang_holder import GangHolder
from workflows.cluster import ClusterWorkflow
from workflows.models import (
    Allocation,
    ClusterState,
    GangRequest,
    NodeFailure,
    NodeInfo,
    NodeState,
    Release,
)
from workflows.names import CLUSTER_WORKFLOW_ID

T = TypeVar("T")


def node(node_id: str, incarnation: str = "a") -> NodeInfo:
    return NodeInfo(node_id=node_id, rdzv_port=29500, incarnation=incarnation)


async def eventually(
    probe: Callable[[], Awaitable[T]], check: Callable[[T], bool], timeout: float = 10
) -> T:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        value = await probe()
        if check(value) or asyncio.get_running_loop().time() > deadline:
            return value
        await asyncio.sleep(0.1)


class Harness:
    def __init__(self, client: Client, task_queue: str, cluster: WorkflowHandle) -> None:
        self.client, self.task_queue, self.cluster = client, task_queue, cluster
        self.holders: list[WorkflowHandle] = []

    async def hold(self, run_id: str, nodes: int) -> WorkflowHandle:
        handle = await self.client.start_workflow(
            GangHolder.run,
            GangRequest(run_id=run_id, nodes=nodes, gpus_per_node=1),
            id=run_id,
            task_queue=self.task_queue,
        )
        self.holders.append(handle)
        return handle

    async def close(self) -> None:
        """Ids repeat across tests: leave no holder running for the next test to collide with."""
        for handle in [*self.holders, self.cluster]:
            with contextlib.suppress(RPCError):
                await handle.terminate("test over")

    async def grants(self, holder: WorkflowHandle, count: int) -> list[Allocation]:
        async def probe() -> list[Allocation]:
            return await holder.query(GangHolder.grants, result_type=list[Allocation])

        return await eventually(probe, lambda grants: len(grants) >= count)

    async def state(self, check: Callable[[ClusterState], bool] = lambda _: True) -> ClusterState:
        async def probe() -> ClusterState:
            return await self.cluster.query(ClusterWorkflow.state, result_type=ClusterState)

        return await eventually(probe, check)


def run_scenario(
    address: str, task_queue: str, scenario: Callable[[Harness], Awaitable[None]]
) -> None:
    async def main() -> None:
        client = await Client.connect(address, data_converter=pydantic_data_converter)
        async with Worker(client, task_queue=task_queue, workflows=[ClusterWorkflow, GangHolder]):
            cluster = await client.start_workflow(
                ClusterWorkflow.run, ClusterState(), id=CLUSTER_WORKFLOW_ID, task_queue=task_queue
            )
            harness = Harness(client, task_queue, cluster)
            try:
                await scenario(harness)
            finally:
                await harness.close()

    asyncio.run(main())


def test_gang_is_all_or_nothing(temporal_address: str, task_queue: str) -> None:
    async def scenario(h: Harness) -> None:
        for n in ("n0", "n1"):
            await h.cluster.signal(ClusterWorkflow.register_node, node(n))
        holder = await h.hold("run-a", nodes=3)
        state = await h.state(lambda s: len(s.queue) == 1)
        assert [r.run_id for r in state.queue] == ["run-a"]
        await asyncio.sleep(0.5)  # give the cluster every chance to (wrongly) grant 2 of 3
        assert await holder.query(GangHolder.grants, result_type=list[Allocation]) == []
        await h.cluster.signal(ClusterWorkflow.register_node, node("n2"))
        (grant,) = await h.grants(holder, 1)
        assert sorted(n.node_id for n in grant.nodes) == ["n0", "n1", "n2"]
        assert grant.generation == 1
        state = await h.state()
        assert all(n.state == NodeState.ALLOCATED and n.run_id == "run-a" for n in state.nodes)
        await holder.signal(GangHolder.finish)

    run_scenario(temporal_address, task_queue, scenario)


def test_release_is_fenced_by_generation(temporal_address: str, task_queue: str) -> None:
    async def scenario(h: Harness) -> None:
        for n in ("n0", "n1"):
            await h.cluster.signal(ClusterWorkflow.register_node, node(n))
        first = await h.hold("run-a", nodes=2)
        (grant,) = await h.grants(first, 1)
        second = await h.hold("run-b", nodes=1)
        await h.state(lambda s: len(s.queue) == 1)

        # A release naming an older generation is stale: nothing moves.
        await h.cluster.signal(
            ClusterWorkflow.release, Release(run_id="run-a", generation=grant.generation - 1)
        )
        state = await h.state()
        assert [a.run_id for a in state.allocations] == ["run-a"]

        await h.cluster.signal(
            ClusterWorkflow.release, Release(run_id="run-a", generation=grant.generation)
        )
        (granted_b,) = await h.grants(second, 1)
        assert granted_b.generation == grant.generation + 1
        for holder in (first, second):
            await holder.signal(GangHolder.finish)

    run_scenario(temporal_address, task_queue, scenario)


def test_failed_node_is_drained_until_it_comes_back(temporal_address: str, task_queue: str) -> None:
    async def scenario(h: Harness) -> None:
        for n in ("n0", "n1", "n2"):
            await h.cluster.signal(ClusterWorkflow.register_node, node(n))
        holder = await h.hold("run-a", nodes=2)
        (grant,) = await h.grants(holder, 1)
        victim = grant.nodes[0].node_id
        stale = NodeFailure(
            run_id="run-a", generation=grant.generation - 1, node_id=victim, reason="old"
        )
        await h.cluster.signal(ClusterWorkflow.report_failure, stale)
        fresh = NodeFailure(
            run_id="run-a", generation=grant.generation, node_id=victim, reason="heartbeat timeout"
        )
        await h.cluster.signal(ClusterWorkflow.report_failure, fresh)
        state = await h.state(lambda s: any(n.state == NodeState.DOWN for n in s.nodes))
        down = [n for n in state.nodes if n.state == NodeState.DOWN]
        assert [(n.info.node_id, n.down_reason) for n in down] == [(victim, "heartbeat timeout")]

        # The run gives the gang back and asks again: it gets the healthy spare, never the
        # drained node, under a new generation.
        await h.cluster.signal(
            ClusterWorkflow.release, Release(run_id="run-a", generation=grant.generation)
        )
        await h.cluster.signal(
            ClusterWorkflow.request_gang, GangRequest(run_id="run-a", nodes=2, gpus_per_node=1)
        )
        grants = await h.grants(holder, 2)
        assert victim not in [n.node_id for n in grants[1].nodes]
        assert grants[1].generation > grant.generation

        # The same agent re-registering is still down; a restarted one (new incarnation) is back.
        await h.cluster.signal(ClusterWorkflow.register_node, node(victim, incarnation="a"))
        state = await h.state()
        assert next(n for n in state.nodes if n.info.node_id == victim).state == NodeState.DOWN
        await h.cluster.signal(ClusterWorkflow.register_node, node(victim, incarnation="b"))
        state = await h.state(lambda s: all(n.state != NodeState.DOWN for n in s.nodes))
        assert next(n for n in state.nodes if n.info.node_id == victim).state == NodeState.IDLE
        await holder.signal(GangHolder.finish)

    run_scenario(temporal_address, task_queue, scenario)
