"""Request-to-grant latency through Temporal: a run's `request_gang` signal to its grant.

    python -m bench.grant_latency [--requests 50] [--nodes 64]

Starts its own Temporal dev server (free ports, in memory) and an in-process worker running the
real `Cluster` workflow, registers nodes, then lets a stand-in run workflow ask for a one-node
gang again and again (releasing it after each grant). Prints median and p99 beside the
round trip of a plain signal + query on the same server, the floor any grant pays.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
import uuid
from pathlib import Path

from temporalio import workflow
from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import Worker

from infra.local_servers import temporal_dev_server_argv
from infra.processes import ManagedProcess, free_port, port_is_open, wait_until

with workflow.unsafe.imports_passed_through():
    from workflows.cluster import ClusterWorkflow
    from workflows.contracts.cluster_models import (
        Allocation,
        ClusterState,
        GangRequest,
        NodeInfo,
        Release,
    )
    from workflows.contracts.names import CLUSTER_WORKFLOW_ID, GANG_GRANTED_SIGNAL


@workflow.defn(name="BenchRun")
class BenchRun:
    """Asks for a gang on start, records when the grant arrives, releases on request."""

    def __init__(self) -> None:
        self._grant: Allocation | None = None
        self._release = False

    @workflow.run
    async def run(self, request: GangRequest) -> None:
        cluster = workflow.get_external_workflow_handle(CLUSTER_WORKFLOW_ID)
        await cluster.signal("request_gang", request)
        await workflow.wait_condition(lambda: self._release)
        assert self._grant is not None
        await cluster.signal(
            "release", Release(run_id=request.run_id, generation=self._grant.generation)
        )

    @workflow.signal(name=GANG_GRANTED_SIGNAL)
    def granted(self, allocation: Allocation) -> None:
        self._grant = allocation

    @workflow.signal
    def release(self) -> None:
        self._release = True

    @workflow.query
    def grant(self) -> Allocation | None:
        return self._grant


@workflow.defn(name="Echo")
class Echo:
    """The floor: a signal in, a query out, nothing else."""

    def __init__(self) -> None:
        self._seen = False
        self._done = False

    @workflow.run
    async def run(self) -> None:
        await workflow.wait_condition(lambda: self._done)

    @workflow.signal
    def ping(self) -> None:
        self._seen = True

    @workflow.signal
    def finish(self) -> None:
        self._done = True

    @workflow.query
    def seen(self) -> bool:
        return self._seen


async def _until(probe, poll_s: float = 0.002) -> None:
    while not await probe():
        await asyncio.sleep(poll_s)


async def measure(address: str, requests: int, nodes: int) -> tuple[list[float], list[float]]:
    client = await Client.connect(address, data_converter=pydantic_data_converter)
    queue = f"bench-{uuid.uuid4().hex[:8]}"
    async with Worker(client, task_queue=queue, workflows=[ClusterWorkflow, BenchRun, Echo]):
        cluster = await client.start_workflow(
            ClusterWorkflow.run, ClusterState(), id=CLUSTER_WORKFLOW_ID, task_queue=queue
        )
        for i in range(nodes):
            info = NodeInfo(node_id=f"n{i}", gpus=8, rdzv_port=1, incarnation="x")
            await cluster.signal(ClusterWorkflow.register_node, info)
        grants, floors = [], []
        for i in range(requests):
            request = GangRequest(run_id=f"run-{i}", nodes=1, gpus_per_node=8)
            started = time.perf_counter()
            run = await client.start_workflow(
                BenchRun.run, request, id=request.run_id, task_queue=queue
            )

            async def granted(run=run) -> bool:
                return await run.query(BenchRun.grant, result_type=Allocation | None) is not None

            await _until(granted)
            grants.append(time.perf_counter() - started)
            await run.signal(BenchRun.release)
            await run.result()

            echo = await client.start_workflow(Echo.run, id=f"echo-{i}", task_queue=queue)
            started = time.perf_counter()
            await echo.signal(Echo.ping)
            await _until(lambda echo=echo: echo.query(Echo.seen))
            floors.append(time.perf_counter() - started)
            await echo.signal(Echo.finish)
        await cluster.terminate("bench over")
    return grants, floors


def _p99(values: list[float]) -> float:
    return sorted(values)[min(len(values) - 1, round(0.99 * (len(values) - 1)))]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=50)
    parser.add_argument("--nodes", type=int, default=64)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="forgeline-bench-") as tmp:
        home, port = Path(tmp), free_port()
        server = ManagedProcess(home, "temporal")
        server.start(temporal_dev_server_argv(home / "t.db", port, 0, headless=True))
        try:
            wait_until(lambda: port_is_open("127.0.0.1", port), 60, "Temporal dev server", server)
            grants, floors = asyncio.run(measure(f"127.0.0.1:{port}", args.requests, args.nodes))
        finally:
            server.stop()
    print(f"request-to-grant through Temporal ({args.nodes} nodes, {args.requests} requests)")
    print(f"{'':28}{'median ms':>10}{'p99 ms':>10}")
    for name, values in (("request → grant (Cluster)", grants), ("signal → query (floor)", floors)):
        print(f"{name:28}{statistics.median(values) * 1e3:>10.1f}{_p99(values) * 1e3:>10.1f}")
    print(f"ratio of medians: {statistics.median(grants) / statistics.median(floors):.1f}×")


if __name__ == "__main__":
    main()
