"""Entry points of the control worker and the node agent (started by `forgeline up`)."""

from __future__ import annotations

import asyncio
import logging
import signal
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from temporalio.client import Client
from temporalio.worker import Worker

from activities.control import ControlActivities
from activities.data import DataActivities
from activities.grants import GrantActivities
from activities.node import NodeActivities
from infra import containers, node_health
from infra.node_hardware import NodeHardware
from infra.processes import free_port
from infra.settings import Settings
from registry.metric_stream import seal_abandoned
from trainer import rank_box
from trainer.launch import LOOPBACK, Fabric
from worker.node_claim import join, previous_incarnation
from worker.preflight import reach_temporal
from worker.process_metrics import NodeAgentMetrics, ProcessMetrics
from worker.process_names import CONTROL
from worker.temporal_client import ensure_cluster, ensure_search_attributes
from workflows.cluster import ClusterWorkflow
from workflows.contracts.cluster_models import NodeHealthReport, NodeInfo
from workflows.contracts.names import (
    CLUSTER_WORKFLOW_ID,
    CONTROL_TASK_QUEUE,
    DATA_TASK_QUEUE,
    node_task_queue,
)
from workflows.dataset import DatasetSnapshotWorkflow
from workflows.training_run import TrainingRun


async def _run_until_signalled(worker: Worker) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: asyncio.ensure_future(worker.shutdown()))
    await worker.run()


async def run_control_worker(settings: Settings) -> None:
    metrics = ProcessMetrics(settings.home, CONTROL)
    client = await reach_temporal(settings, metrics.runtime)
    metrics.serve()
    await ensure_search_attributes(client)
    await ensure_cluster(client)
    activities = ControlActivities(settings)
    with ThreadPoolExecutor(max_workers=4, thread_name_prefix="activity") as pool:
        worker = Worker(
            client,
            task_queue=CONTROL_TASK_QUEUE,
            workflows=[TrainingRun, ClusterWorkflow, DatasetSnapshotWorkflow],
            activities=[*activities.all(), GrantActivities(client).confirm_grant],
            activity_executor=pool,
        )
        logging.info("control worker polling %s", CONTROL_TASK_QUEUE)
        await _run_until_signalled(worker)


async def run_data_worker(settings: Settings, name: str) -> None:
    metrics = ProcessMetrics(settings.home, name)
    client = await reach_temporal(settings, metrics.runtime)
    metrics.serve()
    activities = DataActivities(settings, name)
    # One stage at a time: the work is CPU-bound, so parallelism comes from more data workers
    # (processes), not from threads fighting over one interpreter.
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="data") as pool:
        worker = Worker(
            client,
            task_queue=DATA_TASK_QUEUE,
            activities=activities.all(),
            activity_executor=pool,
            max_concurrent_activities=1,
        )
        logging.info("data worker %s polling %s", name, DATA_TASK_QUEUE)
        await _run_until_signalled(worker)


@dataclass(frozen=True)
class RendezvousPorts:
    """The ports this node serves its gangs' c10d rendezvous on when it is their head: one a
    grant, in turn (NodeInfo.rdzv_ports)."""

    first: int
    count: int = 1

    @classmethod
    def parse(cls, text: str) -> RendezvousPorts:
        """`29400-29463` (a range the operator keeps free for Forgeline) or one port."""
        low, _, high = text.partition("-")
        try:
            first, last = int(low), int(high or low)
        except ValueError:
            first, last = 0, -1
        if not 1024 <= first <= last <= 65535:
            raise ValueError(f"{text!r} is not a port range: use LOW-HIGH within 1024-65535")
        return cls(first, last - first + 1)


async def run_node_agent(
    settings: Settings,
    node_id: str,
    hardware: NodeHardware,
    fabric: Fabric = LOOPBACK,
    pod: str = "local",
    incarnation: str | None = None,
    ports: RendezvousPorts | None = None,
    topology: dict[str, str] | None = None,
    unconfined_user_code: str | None = None,
) -> None:
    node_dir = settings.home / "nodes" / node_id
    # Before anything joins: a wrong --unconfined-user-code is refused at once.
    confinement = rank_box.decide(unconfined_user_code)
    if confinement.mode is not rank_box.Confinement.BOX:
        logging.warning("node %s: user code %s", node_id, confinement.describe())
    previous = previous_incarnation(node_dir, node_id)  # refused here while it still runs
    runtime = containers.detect()
    # A predecessor that died left its containers running (their lifeline is closed, so they
    # are ending): none of them may hold the node's GPUs when this agent's first job starts.
    containers.remove_left_behind(node_id)
    metrics = ProcessMetrics(settings.home, node_id)
    client = await reach_temporal(settings, metrics.runtime)
    # The list agents kept before the cache had a budget: it only grew, so it is not the truth
    # (the cache's own index is, activities.fetch.NodeCache.held).
    (node_dir / "cache" / "snapshots.json").unlink(missing_ok=True)
    # On the local stack any free port will do: the agents share one machine's ports.
    ports = ports or RendezvousPorts(free_port())
    info = NodeInfo(
        node_id=node_id,
        host=fabric.address,
        gpus=hardware.gpus,
        gpu_type=hardware.gpu_type,
        memory_bytes=hardware.memory_bytes,
        peak_flops=hardware.peak_flops,
        pod=pod,
        topology=topology or {},
        rdzv_port=ports.first,
        rdzv_ports=ports.count,
        incarnation=incarnation or uuid.uuid4().hex,
        confinement=confinement.describe()[:300],
        container_runtime=runtime.describe()[:100] if runtime else "",
    )

    async def on_cache_changed(held: dict[str, int]) -> None:
        # Tell the scheduler, which places runs where the least must be fetched, what the node
        # holds now: one fetched, or others evicted to make room. Only the set matters to it,
        # so a mere change of order costs no update.
        nonlocal info
        if held.keys() != info.held.keys():
            info = info.model_copy(update={"held": held})
            await join(client, node_dir, info, previous)

    node_health.repaired(node_dir)  # a new incarnation runs on a repaired node
    activities = NodeActivities(
        settings, node_id, on_cache_changed, fabric, info.incarnation, confinement, runtime
    )
    info = info.model_copy(update={"held": activities.cache.held()})
    # No writer of this node's spool is alive yet: what a crashed predecessor left open is
    # sealed, so it is deleted once shipped. The shipper lives as long as the agent.
    seal_abandoned(activities.metrics_dir)
    launcher = activities.launcher
    metrics.serve(
        NodeAgentMetrics(
            node_id,
            node_dir,
            activities.cache.budget,
            lambda: launcher is not None and launcher.ready,
        )
    )
    shipper = activities.shipper.start()
    worker = Worker(
        client,
        task_queue=node_task_queue(node_id),
        activities=[
            activities.train_on_node,
            activities.stop_training,
            activities.node_alive,
            activities.warm_cache,
        ],
        # Send every heartbeat within a second: progress shows live and cancellation
        # reaches the ranks fast (the default throttle is 0.8 × the heartbeat timeout).
        max_heartbeat_throttle_interval=timedelta(seconds=1),
    )
    # Stopping the agent (SIGTERM) cancels its running activity at once, which stops the
    # ranks before the worker exits.
    # The agent may come up before the control plane has started the Cluster workflow.
    await ensure_cluster(client)
    await join(client, node_dir, info, previous)  # NodeClaimed: another agent holds the id
    logging.info(
        "node %s at %s (%s, %s) registered, polling %s", node_id, fabric.address,
        fabric.interface, hardware.describe(), node_task_queue(node_id),
    )  # fmt: skip
    watch = asyncio.ensure_future(_watch_health(client, info, node_dir))
    # Registered first: a standby's imports (seconds of CPU) never hold up joining the cluster.
    # A boxed node's waits in the box every job's shares (its job's binds are added to it).
    if activities.launcher is not None:
        boxed = confinement.mode is rank_box.Confinement.BOX
        await activities.launcher.prepare(rank_box.standby_box() if boxed else None)
    try:
        await _run_until_signalled(worker)
    finally:
        watch.cancel()
        if activities.launcher is not None:
            await activities.launcher.close()
        # A short last try: what is left waits in the spool for the next agent.
        await asyncio.to_thread(shipper.stop, 3.0)
    await client.get_workflow_handle(CLUSTER_WORKFLOW_ID).signal("node_stopped", info)


async def _watch_health(client: Client, info: NodeInfo, node_dir: Path) -> None:
    """Tell the cluster when this node's own health check changes its verdict: failing takes
    the node out of service, passing again brings it back."""
    reported: str | None = None
    while True:
        reason = node_health.failing(node_dir)
        if reason != reported:
            report = NodeHealthReport(
                node_id=info.node_id,
                incarnation=info.incarnation,
                healthy=reason is None,
                reason=reason or "",
            )
            try:
                await client.get_workflow_handle(CLUSTER_WORKFLOW_ID).signal("node_health", report)
                reported = reason
            except Exception:  # the control plane is away: tell it on the next round
                logging.exception("could not report this node's health")
        await asyncio.sleep(2)
