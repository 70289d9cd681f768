"""A node that dies mid-attempt costs the run seconds, not its heartbeat timeout; nor does it
cost the run itself when the gang is preempted while the node is dead.

The real TrainingRun and Cluster workflows on the dev server. Node n1's agent is a process of
its own (tests/workflows/doomed_agent.py) that the test SIGKILLs while it trains; n0's agent
answers as a survivor does: its ranks' collectives failed, so its activity fails at once. n2
joins after the kill, the node the run recovers onto. The heartbeat timeout is a minute: a
run that waited for it would still be recovering when the test gives up.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import sys
import time
from pathlib import Path

from temporalio import activity
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client, WorkflowHistory
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.exceptions import ApplicationError

from tests.workflows.test_cluster_workflow import eventually, node
from tests.workflows.test_training_run_history import (
    STEPS,
    Control,
    StopsWhenTold,
    _status,
    heartbeat_until,
    record_histories,
    stack_workers,
    start_cluster_and_run,
    terminated_after,
    tiny_spec,
)
from workflows.cluster import ClusterWorkflow
from workflows.contracts.cluster_models import ClusterConfig, ClusterState, Health, PreemptNotice
from workflows.contracts.models import (
    CheckpointRef,
    NodeTrainInput,
    NodeTrainResult,
    Phase,
    RunStatus,
)
from workflows.contracts.names import PREEMPT_SIGNAL
from workflows.gang_outcome import STOP_ORDER_TIMEOUT

REPO = Path(__file__).resolve().parents[2]
HEARTBEAT_TIMEOUT_S = 60
LABEL = "2026-12-08-regrant-beside-probe"
LABEL_PREEMPTED = "2026-12-07-stop-orders"
LABEL_SLOW = "2026-12-08-slow-node"


class Survivors:
    """n0 and n2's agents: generation 1 fails once n1 is dead (as ranks whose peer vanished
    do); later generations train to the end."""

    def __init__(self) -> None:
        self.peer_dead = asyncio.Event()
        self.step = 0  # what Control's latest_checkpoint reports
        self.skipped: list[str] = []  # what later generations' ranks say they passed over
        self.resumes: list[CheckpointRef | None] = []  # what each generation was told

    @activity.defn(name="train_on_node")
    async def train_on_node(self, inp: NodeTrainInput) -> NodeTrainResult:
        self.resumes.append(inp.resume)
        if inp.allocation.generation == 1:
            await heartbeat_until(self.peer_dead)
            raise ApplicationError(
                f"ranks on node {inp.node_id}: Connection closed by peer", type="RanksFailed"
            )
        self.step = STEPS
        return NodeTrainResult(node_id=inp.node_id, generation=inp.allocation.generation,
                               final_step=STEPS, final_loss=1.0, skipped=self.skipped)  # fmt: skip

    @activity.defn(name="node_alive")
    async def node_alive(self) -> str:
        return "a"


def test_a_dead_node_is_left_behind_without_waiting_for_its_heartbeat_timeout(
    temporal_address: str, task_queue: str, tmp_path: Path
) -> None:
    spec = tiny_spec("dead-node", HEARTBEAT_TIMEOUT_S)
    started = tmp_path / "n1-started"
    doomed = subprocess.Popen(
        [sys.executable, "-m", "tests.workflows.doomed_agent", temporal_address, "n1", "a",
         str(started)], cwd=REPO,
    )  # fmt: skip

    async def main() -> tuple[float, dict]:
        client = await Client.connect(temporal_address, data_converter=pydantic_data_converter)
        survivors = Survivors()
        control = Control(survivors)  # type: ignore[arg-type]  # it reads .step alone
        node_activities = [survivors.train_on_node, survivors.node_alive]
        workers = stack_workers(
            client, task_queue, control, dict.fromkeys(("n0", "n2"), node_activities)
        )
        async with contextlib.AsyncExitStack() as stack:
            cluster, handle = await start_cluster_and_run(stack, client, workers, task_queue, spec)
            async with terminated_after(handle, cluster):
                # n2 is the spare: held back from the queue, taken by the recovering gang.
                await cluster.execute_update(
                    ClusterWorkflow.apply_config, ClusterConfig(spare_nodes=1)
                )
                for n in ("n2", "n0", "n1"):  # n2 first: the spare from the start
                    await cluster.signal(ClusterWorkflow.register_node, node(n))
                await eventually(lambda: asyncio.to_thread(started.exists), bool, timeout=60)
                doomed.send_signal(signal.SIGKILL)
                doomed.wait()
                killed_at = time.time()
                survivors.peer_dead.set()
                final = await eventually(
                    lambda: _status(handle),
                    lambda s: s.phase == Phase.AWAITING_APPROVAL,
                    timeout=HEARTBEAT_TIMEOUT_S - 20,
                )
                # The run went on before the dead node's probe ran out; it runs out later.
                history = await eventually(
                    handle.fetch_history, lambda h: "probe timed out" in order(h)
                )
                await record_histories(LABEL, handle, cluster)
                timers = [
                    e.timer_started_event_attributes.start_to_fire_timeout.ToSeconds()
                    for e in history.events
                    if e.event_type == EventType.EVENT_TYPE_TIMER_STARTED
                ]
                return killed_at, {"status": final, "timers": timers, "order": order(history)}

    try:
        killed_at, seen = asyncio.run(main())
    finally:
        doomed.kill()
    status = seen["status"]
    assert status.phase == Phase.AWAITING_APPROVAL, status
    first, second = status.gang_attempts
    assert first.outcome == "failed" and second.outcome == "completed"
    assert second.generation == 2
    # Left behind as dead, by name, and drained: the second gang is n0 and the spare n2.
    dead = [f for f in status.failures if f.node_id == "n1"]
    assert dead and "did not answer a liveness probe" in dead[0].reason, status.failures
    assert any(f.node_id is None and "Connection closed" in f.reason for f in status.failures)
    assert second.granted_at.timestamp() < killed_at + HEARTBEAT_TIMEOUT_S / 2, (second, killed_at)
    # The first failure retries at once: no backoff timer (the teardown's wait for the
    # answers is the only one, half a second).
    assert 1.0 not in seen["timers"], seen["timers"]
    # The gang was given back and the run queued again before the dead node's probe ran out:
    # the next gang did not wait for an answer that was never coming.
    said = seen["order"]
    assert said.index("release") < said.index("probe timed out"), said


def order(history: WorkflowHistory) -> list[str]:
    """The run's signals to the cluster and its probes' ends, in the order they happened."""
    said = []
    probes: set[int] = set()
    for e in history.events:
        if e.event_type == EventType.EVENT_TYPE_SIGNAL_EXTERNAL_WORKFLOW_EXECUTION_INITIATED:
            said.append(e.signal_external_workflow_execution_initiated_event_attributes.signal_name)
        elif e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
            if e.activity_task_scheduled_event_attributes.activity_type.name == "node_alive":
                probes.add(e.event_id)
        elif e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_TIMED_OUT:
            if e.activity_task_timed_out_event_attributes.scheduled_event_id in probes:
                said.append("probe timed out")
        elif e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED:  # noqa: SIM102
            if e.activity_task_completed_event_attributes.scheduled_event_id in probes:
                said.append("probe answered")
    return said


class Crashes(StopsWhenTold):
    """n0 and n2's agents: generation 1's ranks crash once n1's have started (n0's fail on
    their own, blaming no node); later generations train to the end."""

    def __init__(self, started: asyncio.Event) -> None:
        super().__init__()
        self.started = started
        self.trained: list[str] = []  # the nodes of later generations

    @activity.defn(name="train_on_node")
    async def train_on_node(self, inp: NodeTrainInput) -> NodeTrainResult:
        if inp.allocation.generation == 1:
            await heartbeat_until(self.started)
            raise ApplicationError("ranks on node n0: exited with status 1", type="RanksFailed")
        self.trained.append(inp.node_id)
        return self.to_the_end(inp)


class SlowToAnswer:
    """n1's agent, alive but slow: its probe is answered after ANSWER_S, and its ranks stop
    when the cancellation reaches them."""

    def __init__(self, started: asyncio.Event) -> None:
        self.started = started
        self.cancelled = False

    @activity.defn(name="train_on_node")
    async def train_on_node(self, inp: NodeTrainInput) -> NodeTrainResult:
        self.started.set()
        try:
            await heartbeat_until(asyncio.Event())  # until cancelled
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        raise AssertionError("unreachable: the ranks train until cancelled")

    @activity.defn(name="node_alive")
    async def node_alive(self) -> str:
        await asyncio.sleep(ANSWER_S)
        return "a"


ANSWER_S = 1.2  # later than SILENT_AFTER (0.5 s), well within PROBE_TIMEOUT (2 s)


def test_a_slow_node_taken_for_dead_goes_without_the_next_gang_and_comes_back(
    temporal_address: str, task_queue: str
) -> None:
    """n0's ranks crash while n1's agent, alive but slow, takes longer than SILENT_AFTER to
    answer its probe: the run reports n1 down and its next gang goes on n0 and the spare n2,
    without waiting. n1 answers, its ranks stop, and the cluster has it back in service with
    no death on record."""
    spec = tiny_spec("slow-node", HEARTBEAT_TIMEOUT_S)

    async def main() -> tuple[RunStatus, ClusterState, list[str], bool, list[str]]:
        client = await Client.connect(temporal_address, data_converter=pydantic_data_converter)
        started = asyncio.Event()
        crashes, slow = Crashes(started), SlowToAnswer(started)
        control = Control(crashes)  # type: ignore[arg-type]  # it reads .step alone
        quick = [crashes.train_on_node, crashes.node_alive]
        nodes = {"n0": quick, "n2": quick, "n1": [slow.train_on_node, slow.node_alive]}
        workers = stack_workers(client, task_queue, control, nodes)
        async with contextlib.AsyncExitStack() as stack:
            cluster, handle = await start_cluster_and_run(stack, client, workers, task_queue, spec)
            async with terminated_after(handle, cluster):
                await cluster.execute_update(
                    ClusterWorkflow.apply_config, ClusterConfig(spare_nodes=1)
                )
                for n in ("n2", "n0", "n1"):  # n2 first: the spare
                    await cluster.signal(ClusterWorkflow.register_node, node(n))
                final = await eventually(
                    lambda: _status(handle),
                    lambda s: s.phase in (Phase.AWAITING_APPROVAL, Phase.FAILED),
                    timeout=HEARTBEAT_TIMEOUT_S - 20,
                )
                # n1 comes back once its answer is in and its ranks stopped.
                state = await eventually(
                    lambda: cluster.query(ClusterWorkflow.state, result_type=ClusterState),
                    lambda s: all(n.health == Health.HEALTHY for n in s.nodes),
                )
                await record_histories(LABEL_SLOW, handle, cluster)
                said = order(await handle.fetch_history())
                return final, state, said, slow.cancelled, crashes.trained

    status, state, said, cancelled, trained = asyncio.run(main())
    assert status.phase == Phase.AWAITING_APPROVAL, (status.failures, said, trained)
    first, second = status.gang_attempts
    assert (first.outcome, second.outcome) == ("failed", "completed"), status.gang_attempts
    assert sorted(trained) == ["n0", "n2"]  # the next gang, without n1
    taken = [f for f in status.failures if f.node_id == "n1"]
    assert taken and "within 0.5 s" in taken[0].reason, status.failures
    assert said.index("release") < said.index("probe answered") < said.index("node_answered")
    assert cancelled  # its ranks were stopped before it was handed back
    assert all(n.health == Health.HEALTHY for n in state.nodes), state.nodes
    assert state.fail_stops == 0  # only slow: no death on the fleet's record


class Yielders(StopsWhenTold):
    """n0 and n2's agents: generation 1 trains until told to stop (a preemption) and stops at
    its checkpoint; later generations train to the end."""

    @activity.defn(name="train_on_node")
    async def train_on_node(self, inp: NodeTrainInput) -> NodeTrainResult:
        generation = inp.allocation.generation
        if generation == 1:
            await heartbeat_until(self.stop)
            self.step = 1
            return NodeTrainResult(
                node_id=inp.node_id, generation=1, final_step=1, final_loss=1.0, stopped=True,
                stop_reason="asked to stop",
            )  # fmt: skip
        return self.to_the_end(inp)


def test_a_gang_preempted_while_one_of_its_nodes_is_dead_fails_that_node_not_the_run(
    temporal_address: str, task_queue: str, tmp_path: Path
) -> None:
    """A node-deaths soak: a team reclaimed a borrowed gang while an agent of it was dead. Its
    stop order sat in the dead node's queue for 30 s while the reclaiming run waited, then the
    victim failed ("Not enough time to schedule next retry before activity ScheduleToClose
    timeout"). Now every node is told at once and no order is waited for: the dead node's
    activity ends at its heartbeat timeout (5 s here), the gang fails as a node failure, and the
    run resumes on the live node and the new one, well within those 30 s."""
    spec = tiny_spec("preempted-dead", 5)
    started = tmp_path / "n1-started"
    doomed = subprocess.Popen(
        [sys.executable, "-m", "tests.workflows.doomed_agent", temporal_address, "n1", "a",
         str(started)], cwd=REPO,
    )  # fmt: skip

    async def main() -> RunStatus:
        client = await Client.connect(temporal_address, data_converter=pydantic_data_converter)
        agents = Yielders()
        control = Control(agents)  # type: ignore[arg-type]  # it reads .step alone
        acts = [agents.train_on_node, agents.stop_training, agents.node_alive]
        workers = stack_workers(client, task_queue, control, dict.fromkeys(("n0", "n2"), acts))
        async with contextlib.AsyncExitStack() as stack:
            cluster, handle = await start_cluster_and_run(stack, client, workers, task_queue, spec)
            async with terminated_after(handle, cluster):
                for n in ("n0", "n1"):
                    await cluster.signal(ClusterWorkflow.register_node, node(n))
                await eventually(lambda: asyncio.to_thread(started.exists), bool, timeout=60)
                doomed.send_signal(signal.SIGKILL)
                doomed.wait()
                await cluster.signal(ClusterWorkflow.register_node, node("n2"))
                notice = PreemptNotice(generation=1, grace_s=60, reason="a team reclaims")
                await handle.signal(PREEMPT_SIGNAL, notice)
                final = await eventually(
                    lambda: _status(handle),
                    lambda s: s.phase in (Phase.AWAITING_APPROVAL, Phase.FAILED),
                    timeout=STOP_ORDER_TIMEOUT.total_seconds() - 5,
                )
                await record_histories(LABEL_PREEMPTED, handle, cluster)
                return final

    try:
        status = asyncio.run(main())
    finally:
        doomed.kill()
    assert status.phase == Phase.AWAITING_APPROVAL, status
    first, second = status.gang_attempts
    assert (first.outcome, second.outcome) == ("failed", "completed"), status.gang_attempts
    assert [f.node_id for f in status.failures] == ["n1"], status.failures
