"""A TrainingRun that lives through many gang attempts keeps a bounded history and status.

The real TrainingRun and Cluster workflows run on the dev server (whose conftest has it suggest
continue-as-new after a few hundred events); the activities the run calls answer as the
control worker and a node agent would, instantly, so a run can be preempted three dozen times
in half a minute. What is tested is the workflow: that it continues as new between attempts,
carries its status, its queue age and its generation counters across, and keeps every list
of its status bounded while its totals and goodput still count every attempt.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections import defaultdict
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path

import pytest
from temporalio import activity
from temporalio.client import Client, WorkflowExecutionStatus, WorkflowHandle
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.service import RPCError
from temporalio.worker import Worker

from tests.workflows.prepared_dataset import DATASET, PreparedDataset
from tests.workflows.replaying import write_history
from tests.workflows.test_cluster_workflow import eventually, node
from worker.runs import resume
from worker.specfile import load_spec
from workflows.cluster import ClusterWorkflow
from workflows.contracts.cluster_models import ClusterState, GrantCheck, PreemptNotice
from workflows.contracts.models import (
    ApprovalPolicy,
    ApprovalPolicyInput,
    AttemptLedger,
    AttemptLedgerInput,
    CheckpointRef,
    EvalResult,
    EvaluateInput,
    FenceInput,
    LatestCheckpointInput,
    ModelVersionRef,
    NodeStopInput,
    NodeTrainInput,
    NodeTrainResult,
    Phase,
    RegisterInput,
    RunStatus,
    TrackingInput,
    TrainingRunInput,
)
from workflows.contracts.names import (
    CLUSTER_WORKFLOW_ID,
    CONTROL_TASK_QUEUE,
    PREEMPT_SIGNAL,
    node_task_queue,
)
from workflows.contracts.spec import RunSpec
from workflows.run_records import ATTEMPTS_KEPT, KEPT
from workflows.training_run import TrainingRun

REPO = Path(__file__).resolve().parents[2]
# Set to a folder, the test also records the first execution's history (it ends continuing as
# new) and the last one's (a continuation, from its carried status to AWAITING_APPROVAL) for
# the replay test: FORGELINE_RECORD_HISTORIES=tests/workflows/histories.
RECORD_TO = "FORGELINE_RECORD_HISTORIES"
LABEL = "2026-12-02-continue"
PREEMPTIONS = 36  # more than ATTEMPTS_KEPT, so attempts are folded into the goodput too
STEPS = 100


class Node:
    """What a node agent's activities do, without ranks: train until asked to stop."""

    def __init__(self, finish_after: int = PREEMPTIONS) -> None:
        self.stop: dict[int, asyncio.Event] = defaultdict(asyncio.Event)
        self.step = 0  # where the last attempt stopped: each attempt trains a step further
        self.finish_after = finish_after  # generations later than this train to the end

    @activity.defn(name="train_on_node")
    async def train_on_node(self, inp: NodeTrainInput) -> NodeTrainResult:
        generation = inp.allocation.generation
        done = self.stop[generation]
        finishing = generation > self.finish_after  # the last attempt trains to the end
        while not done.is_set() and not finishing:
            activity.heartbeat()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(done.wait(), 0.5)
        self.step = STEPS if finishing else self.step + 1
        return NodeTrainResult(
            node_id=inp.node_id, generation=generation, final_step=self.step, final_loss=1.0,
            stopped=not finishing, stop_reason=None if finishing else "asked to stop",
        )  # fmt: skip

    @activity.defn(name="stop_training")
    async def stop_training(self, inp: NodeStopInput) -> None:
        self.stop[inp.generation].set()


async def heartbeat_until(event: asyncio.Event) -> None:
    """A stand-in's ranks training (beating) until `event` is set."""
    while not event.is_set():
        activity.heartbeat()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), 0.2)


class StopsWhenTold:
    """A stand-in agent's stop order (sets `stop`) and its answer to the liveness probe."""

    def __init__(self) -> None:
        self.stop = asyncio.Event()
        self.step = 0  # what Control's latest_checkpoint reports

    @activity.defn(name="stop_training")
    async def stop_training(self, inp: NodeStopInput) -> None:
        self.stop.set()

    @activity.defn(name="node_alive")
    async def node_alive(self) -> str:
        return "a"

    def to_the_end(self, inp: NodeTrainInput) -> NodeTrainResult:
        """What a node's activity returns when its ranks trained the run to its end."""
        self.step = STEPS
        return NodeTrainResult(node_id=inp.node_id, generation=inp.allocation.generation,
                               final_step=STEPS, final_loss=1.0)  # fmt: skip


class Control:
    """The control worker's activities, as a healthy store and MLflow would answer."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.fenced_at_most: list[int | None] = []  # at_most_step of each gang's fenced look
        self.fences: list[tuple[int, int]] = []  # (generation, resume step) of each fence

    @activity.defn(name="open_tracking_run")
    async def open_tracking_run(self, inp: TrackingInput) -> str:
        return "mlflow-run"

    @activity.defn(name="confirm_grant")
    async def confirm_grant(self, check: GrantCheck) -> bool:
        return True

    @activity.defn(name="latest_checkpoint")
    async def latest_checkpoint(self, inp: LatestCheckpointInput) -> CheckpointRef | None:
        if inp.new_gang:
            self.fenced_at_most.append(inp.at_most_step)
        step = self.node.step
        return CheckpointRef(
            manifest_key=f"runs/{inp.run_id}/checkpoints/step-{step}/MANIFEST.json",
            step=step, generation=inp.max_generation, tokens_seen=step * 64,
        ) if step else None  # fmt: skip

    @activity.defn(name="fence_generation")
    async def fence_generation(self, inp: FenceInput) -> None:
        self.fences.append((inp.generation, inp.resume_step))

    @activity.defn(name="attempt_ledger")
    async def attempt_ledger(self, inp: AttemptLedgerInput) -> AttemptLedger | None:
        return None

    @activity.defn(name="evaluate")
    async def evaluate(self, inp: EvaluateInput) -> EvalResult:
        return EvalResult(step=STEPS, val_loss=1.0, perplexity=2.7, val_tokens=100, sample="")

    @activity.defn(name="register_model")
    async def register_model(self, inp: RegisterInput) -> ModelVersionRef:
        return ModelVersionRef(model_name=inp.spec.model_name, version="1", mlflow_run_id="m")

    @activity.defn(name="approval_policy")
    async def approval_policy(self, inp: ApprovalPolicyInput) -> ApprovalPolicy:
        return ApprovalPolicy()

    def all(self) -> list:
        return [
            self.open_tracking_run, self.confirm_grant, self.latest_checkpoint,
            self.fence_generation,
            self.attempt_ledger, self.evaluate, self.register_model, self.approval_policy,
        ]  # fmt: skip


async def _status(handle: WorkflowHandle) -> RunStatus:
    return await handle.query(TrainingRun.status, result_type=RunStatus)


def stack_workers(
    client: Client, task_queue: str, control: Control, nodes: dict[str, list]
) -> list[Worker]:
    """The workers `forgeline up` starts, with stand-in activities: the Cluster workflow's,
    the control worker's (runs, their prepared dataset, `control`'s activities) and one per
    node with that node's activities."""
    return [
        Worker(client, task_queue=task_queue, workflows=[ClusterWorkflow]),
        Worker(client, task_queue=CONTROL_TASK_QUEUE, workflows=[TrainingRun, PreparedDataset],
               activities=control.all()),
        # Heartbeats reach the server within a second, as the node agent's do
        # (worker.processes_main): a cancellation reaches the activity as soon.
        *(Worker(client, task_queue=node_task_queue(n), activities=acts,
                 max_heartbeat_throttle_interval=timedelta(seconds=1))
          for n, acts in nodes.items()),
    ]  # fmt: skip


async def awaiting_approval(run: WorkflowHandle) -> RunStatus:
    """The run's status once it awaits approval (or as it is after a minute)."""
    return await eventually(
        lambda: _status(run), lambda s: s.phase == Phase.AWAITING_APPROVAL, timeout=60
    )


async def record_histories(
    label: str, run: WorkflowHandle, cluster: WorkflowHandle | None = None
) -> None:
    """With FORGELINE_RECORD_HISTORIES set to a folder: write the run's history (and the
    Cluster workflow's) there for the replay test, as `<label>_<type>_<id>`."""
    folder = os.environ.get(RECORD_TO)
    if not folder:
        return
    write_history(await run.fetch_history(), Path(folder) / f"{label}_TrainingRun_{run.id}")
    if cluster is not None:
        write_history(
            await cluster.fetch_history(),
            Path(folder) / f"{label}_Cluster_{CLUSTER_WORKFLOW_ID}",
        )


@contextlib.asynccontextmanager
async def terminated_after(*handles: WorkflowHandle) -> AsyncIterator[None]:
    """Workflow ids repeat across tests: leave none of these running for the next one."""
    try:
        yield
    finally:
        for handle in handles:
            with contextlib.suppress(RPCError):
                await handle.terminate("test over")


async def start_cluster_and_run(
    stack: contextlib.AsyncExitStack,
    client: Client,
    workers: list[Worker],
    task_queue: str,
    spec: RunSpec,
    resume_from_step: int | None = None,
) -> tuple[WorkflowHandle, WorkflowHandle]:
    """Start the workers (they stop with `stack`), the Cluster workflow on `task_queue` and the
    run on the control queue, as `forgeline up` and `forgeline run` would."""
    for worker in workers:
        await stack.enter_async_context(worker)
    cluster = await client.start_workflow(
        ClusterWorkflow.run, ClusterState(), id=CLUSTER_WORKFLOW_ID, task_queue=task_queue
    )
    run = await client.start_workflow(
        TrainingRun.run,
        TrainingRunInput(spec=spec, spec_sha256="0" * 64, resume_from_step=resume_from_step),
        id=spec.name,
        task_queue=CONTROL_TASK_QUEUE,
    )
    return cluster, run


@contextlib.asynccontextmanager
async def on_one_node(
    temporal_address: str, task_queue: str, spec: RunSpec, control: Control, agent: object
) -> AsyncIterator[WorkflowHandle]:
    """The run started on a stack whose one node, n0, has `agent`'s activities; terminated
    afterwards with the Cluster workflow."""
    client = await Client.connect(temporal_address, data_converter=pydantic_data_converter)
    acts = [agent.train_on_node, agent.stop_training]  # type: ignore[attr-defined]
    workers = stack_workers(client, task_queue, control, {"n0": acts})
    async with contextlib.AsyncExitStack() as stack:
        cluster, run = await start_cluster_and_run(stack, client, workers, task_queue, spec)
        async with terminated_after(run, cluster):
            await cluster.signal(ClusterWorkflow.register_node, node("n0"))
            yield run


def one_node_spec(name: str) -> RunSpec:
    """The tiny spec on one node, `STEPS` steps: the runs these tests drive by hand."""
    spec = load_spec(REPO / "examples" / "tiny.toml")
    return spec.model_copy(update={
        "name": name,
        "resources": spec.resources.model_copy(update={"nodes": 1}),
        "train": spec.train.model_copy(update={"steps": STEPS}),
    })  # fmt: skip


def run_on_two_nodes(
    temporal_address: str, task_queue: str, spec: RunSpec, agents: object, label: str
) -> tuple[RunStatus, ClusterState]:
    """`spec` on nodes n0 and n1, whose agents' activities are `agents`' `train_on_node` and
    `node_alive` (and its `.step` what Control's latest_checkpoint reports), to
    AWAITING_APPROVAL; the histories recorded under `label`. The run's final status and the
    cluster's state."""

    async def main() -> tuple[RunStatus, ClusterState]:
        client = await Client.connect(temporal_address, data_converter=pydantic_data_converter)
        control = Control(agents)  # type: ignore[arg-type]  # it reads .step alone
        acts = [agents.train_on_node, agents.node_alive]  # type: ignore[attr-defined]
        workers = stack_workers(client, task_queue, control, dict.fromkeys(("n0", "n1"), acts))
        async with contextlib.AsyncExitStack() as stack:
            cluster, handle = await start_cluster_and_run(stack, client, workers, task_queue, spec)
            async with terminated_after(handle, cluster):
                for n in ("n0", "n1"):
                    await cluster.signal(ClusterWorkflow.register_node, node(n))
                final = await eventually(
                    lambda: _status(handle),
                    lambda s: s.phase == Phase.AWAITING_APPROVAL,
                    timeout=60,
                )
                await record_histories(label, handle, cluster)
                return final, await cluster.query(ClusterWorkflow.state)

    return asyncio.run(main())


def tiny_spec(name: str, heartbeat_timeout_s: float) -> RunSpec:
    """examples/tiny.toml as run `name`, its gang given up on after `heartbeat_timeout_s`
    without a heartbeat."""
    spec = load_spec(REPO / "examples" / "tiny.toml")
    recovery = spec.recovery.model_copy(update={"heartbeat_timeout_s": heartbeat_timeout_s})
    return spec.model_copy(update={"name": name, "recovery": recovery})


async def _preempt_many_times(client: Client, task_queue: str) -> tuple[RunStatus, list[str], str]:
    spec = one_node_spec("flapping")
    agent = Node()
    control = Control(agent)
    # The control worker is where runs run (`forgeline resume` starts them there).
    workers = stack_workers(client, task_queue, control,
                            {"n0": [agent.train_on_node, agent.stop_training]})  # fmt: skip
    async with contextlib.AsyncExitStack() as stack:
        # As `forgeline resume --from 0` starts it: only the first gang looks no later than
        # that step; continuing as new does not carry it to the fresh executions' first gangs.
        cluster, run = await start_cluster_and_run(
            stack, client, workers, task_queue, spec, resume_from_step=0
        )
        try:
            await cluster.signal(ClusterWorkflow.register_node, node("n0"))
            for generation in range(1, PREEMPTIONS + 1):
                status = await eventually(
                    lambda: _status(client.get_workflow_handle(spec.name)),
                    lambda s, g=generation: s.phase == Phase.TRAINING and s.generation == g,
                )
                assert status.generation == generation, status
                notice = PreemptNotice(generation=generation, grace_s=30, reason="priority")
                await client.get_workflow_handle(spec.name).signal(PREEMPT_SIGNAL, notice)
            final = await eventually(
                lambda: _status(client.get_workflow_handle(spec.name)),
                lambda s: s.phase == Phase.AWAITING_APPROVAL,
                timeout=60,
            )
            assert control.fenced_at_most == [0] + [None] * PREEMPTIONS, control.fenced_at_most
            executions = [e async for e in client.list_workflows(f"WorkflowId = '{spec.name}'")]
            executions.sort(key=lambda e: e.start_time)
            assert executions[0].id == run.id and executions[0].run_id == run.first_execution_run_id
            # `forgeline resume` starts the run again as submitted, not as the continuation
            # that its latest execution was started as.
            await client.get_workflow_handle(spec.name).terminate("to resume it")
            await resume(client, spec.name)
            again = await _status(client.get_workflow_handle(spec.name))
            assert again.continued == again.preemptions_total == again.attempts == 0, again
            assert again.gang_attempts == [] and again.phase == Phase.PREPARING
            return final, [e.run_id for e in executions], cluster.first_execution_run_id or ""
        finally:
            for handle in (client.get_workflow_handle(spec.name), cluster):
                with contextlib.suppress(RPCError):
                    await handle.terminate("test over")


# With the slow tests, to keep `make test` within 15 minutes (25 s of it): make test replays
# this test's recorded histories (2026-12-02-continue_TrainingRun_flapping_0 and _5, a first
# execution and a continuation) against the current code.
@pytest.mark.slow
def test_a_run_preempted_three_dozen_times_continues_as_new_and_keeps_a_bounded_status(
    temporal_address: str, task_queue: str
) -> None:
    async def main() -> tuple[RunStatus, list[str], list[tuple[int, int]]]:
        client = await Client.connect(temporal_address, data_converter=pydantic_data_converter)
        final, runs, cluster_run = await _preempt_many_times(client, task_queue)
        shapes = []  # (events, status) of each execution of the run's workflow id
        record = os.environ.get(RECORD_TO)
        for n, run_id in enumerate(runs):
            handle = client.get_workflow_handle("flapping", run_id=run_id)
            history = await handle.fetch_history()
            shapes.append((len(history.events), (await handle.describe()).status))
            if record and n in (0, len(runs) - 1):  # the first history, and a continuation
                write_history(history, Path(record) / f"{LABEL}_TrainingRun_flapping_{n}")
        if record:  # the Cluster workflow's first run: nodes joining with the bounded-cached patch
            cluster = client.get_workflow_handle(CLUSTER_WORKFLOW_ID, run_id=cluster_run)
            history = await cluster.fetch_history()
            write_history(history, Path(record) / f"{LABEL}_Cluster_{CLUSTER_WORKFLOW_ID}")
        return final, runs, shapes

    final, _, shapes = asyncio.run(main())
    # Before: one history of every attempt (about 40 events each) and a status listing every
    # preemption and attempt.
    assert final.continued >= 2, final.continued
    assert sum(1 for _, s in shapes if s == WorkflowExecutionStatus.CONTINUED_AS_NEW) >= 2
    assert max(events for events, _ in shapes) < 700, shapes
    assert final.preemptions_total == PREEMPTIONS
    assert len(final.preemptions) == KEPT
    assert [p.generation for p in final.preemptions] == list(
        range(PREEMPTIONS - KEPT + 1, PREEMPTIONS + 1)
    )
    assert len(final.gang_attempts) == ATTEMPTS_KEPT
    assert final.goodput is not None and final.goodput.attempts == PREEMPTIONS + 1
    assert final.earlier_goodput is not None
    assert final.earlier_goodput.attempts == PREEMPTIONS + 1 - ATTEMPTS_KEPT
    assert final.generation == PREEMPTIONS + 1  # the counters travelled: no generation reused
    assert final.mlflow_run_id == "mlflow-run" and final.dataset == DATASET
    assert final.last_checkpoint is not None and final.last_checkpoint.step == STEPS
