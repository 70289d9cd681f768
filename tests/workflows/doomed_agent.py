"""A node agent's worker in a process of its own, for a test to SIGKILL mid-attempt.

    python -m tests.workflows.doomed_agent TEMPORAL_ADDRESS NODE_ID INCARNATION STARTED_FILE

It trains (heartbeats) until killed and answers the liveness probe, on the node's task queue,
as worker.processes_main's agent does. It writes STARTED_FILE once its training activity runs.
"""

from __future__ import annotations

import asyncio
import sys
from datetime import timedelta
from pathlib import Path

from temporalio import activity
from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import Worker

from workflows.contracts.models import NodeTrainInput, NodeTrainResult
from workflows.contracts.names import node_task_queue


async def main(address: str, node_id: str, incarnation: str, started: Path) -> None:
    @activity.defn(name="train_on_node")
    async def train_on_node(inp: NodeTrainInput) -> NodeTrainResult:
        started.write_text(str(inp.allocation.generation))
        while True:
            activity.heartbeat()
            await asyncio.sleep(0.2)

    @activity.defn(name="node_alive")
    async def node_alive() -> str:
        return incarnation

    client = await Client.connect(address, data_converter=pydantic_data_converter)
    worker = Worker(
        client,
        task_queue=node_task_queue(node_id),
        activities=[train_on_node, node_alive],
        max_heartbeat_throttle_interval=timedelta(seconds=1),
    )
    await worker.run()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3], Path(sys.argv[4])))
