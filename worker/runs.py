"""Client-side view of runs: submit, attach, read status and live training progress."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

from temporalio.client import Client, WorkflowHandle
from temporalio.common import WorkflowIDReusePolicy
from temporalio.exceptions import WorkflowAlreadyStartedError
from temporalio.service import RPCError, RPCStatusCode

from infra import code_snapshot
from infra.settings import Settings
from worker.cli_common import CliError
from worker.specfile import spec_sha256
from workflows.contracts import api_models as wire
from workflows.contracts.cluster_models import ClusterState
from workflows.contracts.models import (
    CodeRef,
    DatasetProgress,
    Phase,
    RunStatus,
    TrainingRunInput,
    TrainProgress,
)
from workflows.contracts.names import CLUSTER_WORKFLOW_ID, CONTROL_TASK_QUEUE
from workflows.contracts.spec import RunSpec
from workflows.scheduling import topology

QUERY_TIMEOUT = timedelta(seconds=10)


class RunNotFound(Exception):
    pass


class ClusterLacks(CliError):
    """A spec asks for what no node of the cluster has; `field` is the spec field to change."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


# One view of a run for the CLI, the API and the client: the API's own model.
RunView = wire.RunView


def publish_code(settings: Settings, spec: RunSpec) -> CodeRef | None:
    """Upload the spec's train.code folder as a content-addressed snapshot (a no-op when the
    store holds it), before the run starts: the nodes fetch exactly this, wherever they are."""
    if spec.train.code is None:
        return None
    published = code_snapshot.publish(settings.open_store(), Path(spec.train.code))
    return CodeRef.model_validate(published, from_attributes=True)


async def cluster_state(client: Client) -> ClusterState:
    """The Cluster workflow's view: nodes, queue, allocations."""
    return await client.get_workflow_handle(CLUSTER_WORKFLOW_ID).query(
        "state", result_type=ClusterState, rpc_timeout=QUERY_TIMEOUT
    )


async def refuse_what_the_cluster_lacks(client: Client, spec: RunSpec) -> None:
    """A spec that asks for what the cluster does not have (`cluster_lacks`), refused before
    it starts; the cluster's state is read only when the spec asks for any such thing."""
    res = spec.resources
    if res.gpu_type is None and res.topology is None and spec.train.image is None:
        return
    if (lack := cluster_lacks(spec, await cluster_state(client))) is not None:
        raise lack


def cluster_lacks(spec: RunSpec, state: ClusterState) -> ClusterLacks | None:
    """Why `spec` would wait forever or fail on the cluster `state` describes, with what the
    cluster has: a `gpu_type` no registered node reports (the agents' NVML names, e.g.
    `h100-80gb-hbm3`), a topology level the cluster file does not declare, or an image where
    no node runs containers. A cluster with no node registered yet is not judged on GPU types
    or images."""
    wanted, level, image = spec.resources.gpu_type, spec.resources.topology, spec.train.image
    if image is not None and state.nodes and not any(n.info.container_runtime for n in state.nodes):
        return ClusterLacks(
            f"train.image = {image!r} needs a container runtime on the nodes, and no node of "
            "this cluster has one (`forgeline nodes`): its operator may install podman on "
            "them, or leave train.image out and give train.code a requirements.txt",
            "train.image",
        )
    if level is not None and level not in topology.names(state.config.levels):
        return ClusterLacks(
            f"resources.topology = {level!r} is a level this cluster does not declare: its "
            f"levels are {', '.join(topology.names(state.config.levels))} (the cluster file's "
            "`levels`); use one of them or leave it unset",
            "resources.topology",
        )
    reported = sorted({node.info.gpu_type for node in state.nodes})
    if wanted is not None and reported and wanted not in reported:
        return ClusterLacks(
            f"resources.gpu_type = {wanted!r} is a type no node reports: the nodes report "
            f"{', '.join(reported)}; use one of them (`forgeline nodes`) or leave it unset",
            "resources.gpu_type",
        )
    return None


async def submit(
    client: Client, spec: RunSpec, spec_sha256: str, code: CodeRef | None = None
) -> tuple[WorkflowHandle, bool]:
    """Start the run, or attach to the one with this name; True when this call started it."""
    try:
        handle = await client.start_workflow(
            "TrainingRun",
            TrainingRunInput(
                spec=spec,
                spec_sha256=spec_sha256,
                submitted_by=spec.owner,
                code=code,
                run_uid=uuid.uuid4().hex,  # its checkpoints are this run's, not the name's
            ),
            id=spec.name,
            task_queue=CONTROL_TASK_QUEUE,
            # A name is a run forever: submitting it again attaches instead of retraining.
            id_reuse_policy=WorkflowIDReusePolicy.REJECT_DUPLICATE,
        )
        return handle, True
    except WorkflowAlreadyStartedError:
        return client.get_workflow_handle(spec.name), False


async def view(client: Client, name: str) -> RunView:
    handle = client.get_workflow_handle(name)
    try:
        description = await handle.describe()
    except RPCError as err:
        if err.status == RPCStatusCode.NOT_FOUND:
            raise RunNotFound(f"no run named {name!r}: see `forgeline runs`") from None
        raise
    status = await handle.query("status", result_type=RunStatus, rpc_timeout=QUERY_TIMEOUT)
    progress = None
    retrying = []
    for pending in description.raw_description.pending_activities:
        if pending.attempt > 1 and pending.last_failure.message:
            retrying.append(
                f"{pending.activity_type.name} attempt {pending.attempt}: "
                f"{pending.last_failure.message.splitlines()[0]}"
            )
        details = pending.heartbeat_details.payloads
        if pending.activity_type.name != "train_on_node" or not details:
            continue
        (beat,) = await client.data_converter.decode(details, [TrainProgress])
        if beat.generation == status.generation and (progress is None or beat.step > progress.step):
            progress = beat
    dataset = None
    if status.phase == Phase.PREPARING and status.dataset_workflow_id:
        dataset = await dataset_progress(client, status.dataset_workflow_id)
    execution = description.status.name if description.status else None
    return RunView(
        status=status, progress=progress, execution=execution, retrying=retrying, dataset=dataset
    )


async def dataset_progress(client: Client, workflow_id: str) -> DatasetProgress | None:
    try:
        return await client.get_workflow_handle(workflow_id).query(
            "progress", result_type=DatasetProgress, rpc_timeout=QUERY_TIMEOUT
        )
    except RPCError:  # not started yet
        return None


async def list_run_names(client: Client, limit: int = 200, *, open_only: bool = False) -> list[str]:
    query = "WorkflowType = 'TrainingRun'"
    if open_only:  # awaiting approval is still open; approved, failed and cancelled are not
        query += " AND ExecutionStatus = 'Running'"
    names = []
    async for execution in client.list_workflows(query, limit=limit):
        names.append(execution.id)
    return names


async def submitted_input(client: Client, name: str) -> TrainingRunInput | None:
    """What the run's latest execution was started with (spec, its digest, submitter, code),
    from the first event of its history (None: the history is gone, past the namespace's
    retention)."""
    async for event in client.get_workflow_handle(name).fetch_history_events():
        payloads = event.workflow_execution_started_event_attributes.input.payloads
        if not payloads:
            return None
        (started,) = await client.data_converter.decode(payloads, [TrainingRunInput])
        return started
    return None


async def submitted_spec(client: Client, name: str) -> RunSpec | None:
    """The spec the run was started with (None: its history is gone)."""
    started = await submitted_input(client, name)
    return started.spec if started is not None else None


async def resume(
    client: Client,
    name: str,
    from_step: int | None = None,
    change: Callable[[RunSpec], RunSpec] | None = None,
) -> None:
    """Start the run again, under its name, with what it was first started with: a new
    execution of its workflow, which resumes from the run's last committed checkpoint (the
    store's, found by the run's name; with `from_step`, the one at that step) with a fresh
    restart budget; `change` may alter the spec it runs by (forgeline resume --nodes)."""
    started = await submitted_input(client, name)
    if started is None:
        raise RunNotFound(f"run {name}'s history is gone (past the namespace's retention)")
    spec = change(started.spec) if change is not None else started.spec
    await client.start_workflow(
        "TrainingRun",
        # As submitted: a latest execution that continued as new carries the old status,
        # which a resumed run (a fresh restart budget, its own phases) starts without.
        started.model_copy(
            update={
                "carried": None,
                "resume_from_step": from_step,
                "spec": spec,
                "spec_sha256": spec_sha256(spec) if spec != started.spec else started.spec_sha256,
            }
        ),
        id=name,
        task_queue=CONTROL_TASK_QUEUE,
        # Only here: a submit never starts a name twice (it attaches instead).
        id_reuse_policy=WorkflowIDReusePolicy.ALLOW_DUPLICATE,
    )
