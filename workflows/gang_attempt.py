"""One gang attempt of the TrainingRun workflow: a training activity on every node of the
allocation, all or nothing, until every node is done, one failed, the run was preempted, or
the ranks of some nodes ended at the run's end and the others' were left behind. What it
returns is every node's result; every other way it ends is an exception that says what the
run does next (`workflows.gang_outcome`: GangFailed, Preempted, StragglerSwap, or the user's
own error). Runs in the workflow: deterministic, and its commands are the workflow's.
"""

from __future__ import annotations

import asyncio
import builtins
from collections.abc import Callable
from datetime import timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy

from workflows.contracts.cluster_models import Allocation, PreemptNotice
from workflows.contracts.models import (
    CheckpointRef,
    DatasetRef,
    NodeStopInput,
    NodeTrainInput,
    NodeTrainResult,
    RunStatus,
    TrainingRunInput,
)
from workflows.contracts.names import node_task_queue
from workflows.gang_outcome import (
    PROBE_TIMEOUT,
    STOP_ORDER_TIMEOUT,
    GangFailed,
    Preempted,
    answering_after_timeout,
    cancel_all,
    ended_at_the_end,
    failures_of,
    order_stops,
    reached_the_end,
    stop_left_behind,
    stopped_early,
    straggler_swap,
    swap_refused,
    tear_down,
    user_code_failure,
)
from workflows.run_records import add_skipped, newest
from workflows.silent_nodes import SILENT_AFTER, Confirmation, tear_down_quickly

# A gang attempt is never retried by Temporal: the workflow itself restarts the whole gang.
_NO_RETRY = RetryPolicy(maximum_attempts=1)
# A node agent that does not pick up its activity within this long is treated as down.
_NODE_PICKUP_TIMEOUT = timedelta(seconds=60)


async def run_gang(
    inp: TrainingRunInput,
    status: RunStatus,
    allocation: Allocation,
    dataset: DatasetRef,
    resume: CheckpointRef | None,
    preempted: Callable[[], PreemptNotice | None],
) -> list[NodeTrainResult]:
    """One attempt: a training activity on every node of the gang, all or nothing.
    `preempted` reads the workflow's preemption notice for this generation (a signal may set
    it at any time); `status` gets what the attempt learned (health, skipped peer copies)."""
    spec = inp.spec
    handles = [
        workflow.start_activity(
            "train_on_node",
            NodeTrainInput(
                run_id=spec.name,
                # Elastic: a gang granted fewer nodes trains the same global batch.
                spec=spec.after_swaps(status.swaps).on_nodes(len(allocation.nodes)),
                dataset=dataset,
                allocation=allocation,
                node_id=node.node_id,
                resume=resume,
                init_from=status.init_from,
                mlflow_run_id=status.mlflow_run_id,
                code=inp.code,
                run_uid=inp.run_uid,
            ),
            result_type=NodeTrainResult,
            task_queue=node_task_queue(node.node_id),
            activity_id=f"train-g{allocation.generation}-{node.node_id}",
            schedule_to_start_timeout=_NODE_PICKUP_TIMEOUT,
            start_to_close_timeout=timedelta(days=30),
            heartbeat_timeout=timedelta(seconds=spec.recovery.heartbeat_timeout_s),
            retry_policy=_NO_RETRY,
            # Wait for the ranks to be gone before the nodes are released to someone else.
            cancellation_type=workflow.ActivityCancellationType.WAIT_CANCELLATION_COMPLETED,
        )
        for node in allocation.nodes
    ]
    # Runs from before waited for every node, even one whose ranks never exit.
    lingering = workflow.patched("stop-ranks-left-behind")
    train = spec.train
    try:
        await workflow.wait_condition(
            lambda: (
                preempted() is not None
                or all(h.done() for h in handles)
                or any(h.done() and h.exception() is not None for h in handles)
                or (lingering and any(ended_at_the_end(train, h) for h in handles))
            )
        )
    except asyncio.CancelledError:
        await cancel_all(handles)
        raise
    left: list[workflow.ActivityHandle] = []
    if lingering and preempted() is None:
        grace = timedelta(seconds=spec.recovery.exit_grace_s)
        left, reported = await stop_left_behind(allocation, handles, train, grace)
        status.health = newest(status.health, reported)
    if (notice := preempted()) is not None and not all(h.done() for h in handles):
        await _stop_gracefully(spec.name, allocation, handles, notice)
    ended = [h for h in handles if h not in left]
    if all(h.done() and h.exception() is None for h in ended):
        results = [h.result() for h in ended]
        # A peer-tier checkpoint the gang could not assemble, and why (the ranks said).
        add_skipped(status, [why for r in results for why in r.skipped])
        # Read again: a later notice may have come while the ranks were stopping.
        if (notice := preempted()) is not None and not reached_the_end(train, results[0]):
            raise Preempted(notice, results[0].final_step)
        if swap := straggler_swap(results):
            refused = swap_refused(
                swap, spec.recovery, status.swaps, allocation.generation, workflow.now()
            )
            # Runs from before cordoned whatever the ranks named, as often as they asked.
            if refused is not None and workflow.patched("swaps-bounded"):
                raise GangFailed([refused])
            raise swap
        early = stopped_early(results, train, allocation.generation, workflow.now())
        if early:
            raise GangFailed(early)
        return results
    silent: frozenset[str] = frozenset()
    out: list[Confirmation] = []
    within = PROBE_TIMEOUT
    # Runs from before waited out the silent nodes' probes before the next gang.
    if workflow.patched("regrant-beside-probe"):
        silent, out = await tear_down_quickly(allocation, handles)
        within = SILENT_AFTER
    elif workflow.patched("probe-silent-nodes"):  # a dead node is not waited for
        silent = await tear_down(allocation, handles)
    else:
        await cancel_all(handles)
    if mistake := user_code_failure(handles):
        # The script's own error: another attempt would fail the same way, and no node is
        # to blame. The run fails now, with the user's traceback, spending no restart.
        raise mistake
    answered: frozenset[str] = frozenset()
    # Runs from before took every timed-out node for dead, control plane down or not.
    if workflow.patched("probe-timed-out-nodes"):
        answered = await answering_after_timeout(allocation, handles)
    failures = failures_of(allocation, handles, workflow.now(), silent, answered, within)
    raise GangFailed(failures, out)


async def _stop_gracefully(
    run_id: str, allocation: Allocation, handles: list, notice: PreemptNotice
) -> None:
    """Ask every node's ranks to checkpoint and exit; after the grace period, stop them."""
    stop = NodeStopInput(run_id=run_id, generation=allocation.generation)
    if workflow.patched("stop-orders-unawaited"):
        order_stops(stop, allocation)
    else:  # runs from before: one order after another, and one not taken failed the run
        for node in allocation.nodes:
            await workflow.execute_activity(
                "stop_training",
                stop,
                task_queue=node_task_queue(node.node_id),
                schedule_to_close_timeout=STOP_ORDER_TIMEOUT,
                retry_policy=_NO_RETRY,
            )
    try:
        await workflow.wait_condition(
            lambda: all(h.done() for h in handles), timeout=timedelta(seconds=notice.grace_s)
        )
    except builtins.TimeoutError:
        await cancel_all(handles)
        raise Preempted(notice, None) from None
