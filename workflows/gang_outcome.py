"""How one attempt of a gang ended, in the TrainingRun workflow's terms: preempted, failed (and
which nodes are suspect), or stopped early by someone else. Deterministic: the time comes from
the workflow.
"""

from __future__ import annotations

import asyncio
import builtins
from datetime import datetime, timedelta
from typing import TYPE_CHECKING

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import (
    ActivityError,
    ApplicationError,
    CancelledError,
    TimeoutError,
    TimeoutType,
)

from workflows.contracts.cluster_models import Allocation, NodeInfo, PreemptNotice
from workflows.contracts.models import Failure, HealthEvent, NodeStopInput, NodeTrainResult
from workflows.contracts.names import node_task_queue
from workflows.contracts.spec import RecoverySpec, TrainSpec

if TYPE_CHECKING:
    from workflows.silent_nodes import Confirmation

# How long a live node agent takes at most to answer the liveness probe: the task waits in its
# queue for one of the agent's idle pollers (milliseconds), the answer is a constant. A node
# that says nothing within this long is dead or cut off.
PROBE_TIMEOUT = timedelta(seconds=2)
STOP_ORDER_TIMEOUT = timedelta(seconds=30)  # a stop order not taken within this is dropped


class Preempted(Exception):
    """The cluster took the gang back (after the ranks checkpointed, or the grace ran out)."""

    def __init__(self, notice: PreemptNotice, step: int | None) -> None:
        super().__init__(notice.reason)
        self.notice = notice
        self.step = step


class GangFailed(Exception):
    """One attempt of the gang ended in failure; carries what was learned about the nodes, and
    the probes still out for nodes taken for dead (workflows.silent_nodes)."""

    def __init__(
        self, failures: list[Failure], confirmations: list[Confirmation] | None = None
    ) -> None:
        super().__init__("; ".join(f.reason for f in failures))
        self.failures = failures
        self.confirmations = confirmations or []


class StragglerSwap(Exception):
    """The gang checkpointed at `step` and stopped to leave a straggling node behind."""

    def __init__(self, event: HealthEvent, step: int) -> None:
        super().__init__(event.evidence)
        self.event = event
        self.step = step


def straggler_swap(results: list[NodeTrainResult]) -> StragglerSwap | None:
    """The swap the ranks asked for by stopping (policy `swap`), if they did."""
    head = results[0]
    if not (head.stopped and (head.stop_reason or "").startswith("straggler")):
        return None
    swaps = [e for r in results for e in r.health if e.kind == "straggler" and e.action == "swap"]
    if not swaps:
        return None
    return StragglerSwap(swaps[-1], head.final_step)


def swap_refused(
    swap: StragglerSwap, recovery: RecoverySpec, swaps: int, generation: int, now: datetime
) -> Failure | None:
    """The failure a swap becomes when the run may not make it, else None. A swap is asked
    for by the ranks (a progress line a script can write as well as the straggler watch), and
    each one cordons a node: a run swaps only under `straggler_policy = "swap"` and at most
    `max_swaps` times. The honest watch stops asking past that (RunSpec.after_swaps); ranks
    that ask anyway stopped early with a checkpoint, which counts as a failure (a restart
    spent, so it cannot repeat for ever) that blames no node."""
    if recovery.straggler_policy == "swap" and swaps < recovery.max_swaps:
        return None
    if recovery.straggler_policy != "swap":
        why = f'recovery.straggler_policy is "{recovery.straggler_policy}", not "swap"'
    else:
        why = f"the run has made its recovery.max_swaps = {recovery.max_swaps} swap(s)"
    node = swap.event.node_id or "a node"
    return Failure(
        generation=generation,
        node_id=None,
        reason=f"the ranks stopped at step {swap.step} asking to swap out {node} "
        f"({swap.event.evidence}), but {why}: {node} is not cordoned, and the stop counts as "
        "a failed attempt",
        at=now,
    )


def failures_of(
    allocation: Allocation,
    handles: list[workflow.ActivityHandle],
    now: datetime,
    silent: frozenset[str] = frozenset(),
    answered: frozenset[str] = frozenset(),
    silent_within: timedelta = PROBE_TIMEOUT,
) -> list[Failure]:
    """One failure per node whose activity failed (cancellations are our own doing); a node
    that went silent (no heartbeat, or no answer to the probe of `tear_down`) is named as
    suspect so the cluster drains it. A node whose activity timed out but whose agent then
    answered the probe as granted (`answered`, from `answering_after_timeout`) is not: the
    silence was the control plane's."""
    failures = []
    for node, handle in zip(allocation.nodes, handles, strict=True):
        if node.node_id in answered:
            failures.append(
                Failure(
                    generation=allocation.generation,
                    node_id=None,
                    reason=f"{node.node_id}: {describe(handle.exception())}, but its agent "
                    "answers as granted: its heartbeats did not reach Temporal (a server or "
                    "worker restart, a cut to the control plane); the node stays in service",
                    at=now,
                )
            )
            continue
        if node.node_id in silent:
            failures.append(
                Failure(
                    generation=allocation.generation,
                    node_id=node.node_id,
                    reason=silent_reason(node.node_id, silent_within),
                    at=now,
                    kind="fail-stop",
                )
            )
            continue
        err = handle.exception()
        if err is None or _is_cancel(err):
            continue
        failures.append(
            Failure(
                generation=allocation.generation,
                node_id=node.node_id if _node_is_suspect(err) else None,
                reason=f"{node.node_id}: {describe(err)}",
                at=now,
                kind="unhealthy" if _failed_its_check(err) else "fail-stop",
            )
        )
    return failures or [
        Failure(
            generation=allocation.generation,
            node_id=None,
            reason="the gang stopped without a reported cause",
            at=now,
        )
    ]


def silent_reason(node_id: str, within: timedelta) -> str:
    """What the run tells the cluster of a node that did not answer its probe in time."""
    return (
        f"{node_id}: its agent did not answer a liveness probe within "
        f"{within.total_seconds():g} s after its peers failed (presumed dead)"
    )


def reached_the_end(train: TrainSpec, result: NodeTrainResult) -> bool:
    """The node's ranks trained to the run's end: the SDK's, to train.steps; a script that
    keeps its own checkpoints decides its own length, and ended when its ranks all returned."""
    if train.keeps_its_own_checkpoints:
        return result.finished
    return result.final_step >= train.steps


def stopped_early(
    results: list[NodeTrainResult], train: TrainSpec, generation: int, now: datetime
) -> list[Failure]:
    """Nodes whose ranks stopped before the end without the run asking (the machine or an
    operator sent SIGTERM). They committed a checkpoint first, so the next attempt loses
    nothing; no node is suspect."""
    return [
        Failure(
            generation=generation,
            node_id=None,
            reason=f"{r.node_id}: ranks stopped ({r.stop_reason}) at step {r.final_step} "
            "after committing a checkpoint",
            at=now,
        )
        for r in results
        if r.stopped and not reached_the_end(train, r)
    ]


def ended_at_the_end(train: TrainSpec, handle: workflow.ActivityHandle) -> bool:
    """The node's activity returned with its ranks at the run's end."""
    return handle.done() and handle.exception() is None and reached_the_end(train, handle.result())


async def stop_left_behind(
    allocation: Allocation,
    handles: list[workflow.ActivityHandle],
    train: TrainSpec,
    grace: timedelta,
) -> tuple[list[workflow.ActivityHandle], list[HealthEvent]]:
    """Once one node's ranks have ended at the run's end, the others' end within seconds. A
    rank stuck in its own teardown never does (a script's process group freed with its peer
    gone, seen with gloo): its node's activity runs on, the gang is never done, and the run
    waited in TRAINING for ever. Past `grace` those nodes' ranks are stopped and reported; the
    gang has ended all the same (its checkpoints are committed; the node is not blamed).
    Returns the activities stopped, and what is reported of them."""
    if all(h.done() for h in handles) or not any(ended_at_the_end(train, h) for h in handles):
        return [], []

    def over() -> bool:  # all ended, or one failed meanwhile (then the gang failed after all)
        return all(h.done() for h in handles) or any(
            h.done() and h.exception() is not None for h in handles
        )

    try:
        await workflow.wait_condition(over, timeout=grace)
        return [], []
    except builtins.TimeoutError:
        pass
    left = [(node, h) for node, h in zip(allocation.nodes, handles, strict=True) if not h.done()]
    await cancel_all([h for _, h in left])
    reported = [
        HealthEvent(
            generation=allocation.generation,
            node_id=node.node_id,
            kind="left-behind",
            evidence=f"its ranks had not exited {grace.total_seconds():g} s after another "
            "node's ended at the run's end (stuck in their teardown?): stopped",
            at=workflow.now(),
        )
        for node, _ in left
    ]
    return [h for _, h in left], reported


def request_cancel(handles: list[workflow.ActivityHandle]) -> None:
    for handle in handles:
        if not handle.done():
            handle.cancel()


async def cancel_all(handles: list[workflow.ActivityHandle]) -> None:
    request_cancel(handles)
    await asyncio.gather(*handles, return_exceptions=True)


async def tear_down(
    allocation: Allocation, handles: list[workflow.ActivityHandle]
) -> frozenset[str]:
    """Cancel a failed gang's activities without waiting on the dead: the nodes that did not
    answer a liveness probe.

    A live agent acknowledges the cancellation once its ranks are stopped (a second or two:
    it heartbeats every second). A dead one never does; its activity ends only at its heartbeat
    timeout, which is what the run used to wait for. So every node still running is probed: one
    that answers as the incarnation it was granted as is waited for, as before (its nodes are
    not given back while its ranks may run); one that does not, or that answers as a restarted
    agent (the old one's ranks died with it), is left behind and returned, to be drained. Its
    activity's late end is observed and dropped."""
    request_cancel(handles)
    running = [(n, h) for n, h in zip(allocation.nodes, handles, strict=True) if not h.done()]
    alive = await asyncio.gather(*(answers_as_granted(node) for node, _ in running))
    silent = frozenset(node.node_id for (node, _), ok in zip(running, alive, strict=True) if not ok)
    for node, handle in running:
        if node.node_id in silent:
            handle.add_done_callback(observe)
    await asyncio.gather(
        *(h for n, h in running if n.node_id not in silent), return_exceptions=True
    )
    return silent


async def answering_after_timeout(
    allocation: Allocation, handles: list[workflow.ActivityHandle]
) -> frozenset[str]:
    """The nodes whose activity timed out (no heartbeat, or never picked up) and whose agent
    answers the liveness probe as the incarnation it was granted as. A Temporal server that
    restarts, or a control worker's outage, times out every gang's heartbeats at once: taken
    for deaths, they took every node of the fleet out of service for good, as only a new
    incarnation of an agent brings a dead node back (found by bench/soak.py)."""
    timed_out = [
        node
        for node, handle in zip(allocation.nodes, handles, strict=True)
        if handle.done() and _timed_out(handle.exception())
    ]
    alive = await asyncio.gather(*(answers_as_granted(node) for node in timed_out))
    return frozenset(n.node_id for n, ok in zip(timed_out, alive, strict=True) if ok)


async def answers_as_granted(node: NodeInfo) -> bool:
    """Whether the node's agent answers the probe as the incarnation it was granted as. An
    agent of a release without the probe fails it at once, which a live agent alone can do;
    one that answers without an incarnation (a test's) is taken at its word."""
    try:
        answer = await workflow.execute_activity(
            "node_alive",
            task_queue=node_task_queue(node.node_id),
            result_type=str,
            schedule_to_start_timeout=PROBE_TIMEOUT,
            start_to_close_timeout=PROBE_TIMEOUT,
            retry_policy=RetryPolicy(maximum_attempts=1),
        )
    except ActivityError as err:
        return not isinstance(err.cause, TimeoutError)
    return answer in ("", node.incarnation)


def order_stops(stop: NodeStopInput, allocation: Allocation) -> None:
    """Tell every node of the gang at once to checkpoint and stop, and wait for none of the
    orders: the gang's own activities say when each node stopped. A node whose agent died
    after the grant never takes its order; its training activity ends at its heartbeat
    timeout, and the gang's end is then a failure of that node, not of the run. Before, the
    orders went one after another and one not taken within 30 s failed the whole run, while
    the run that reclaimed the nodes waited for them (bench/soak.py: a reclaim while an agent
    of the victim's gang was dead)."""
    for node in allocation.nodes:
        order = workflow.start_activity(
            "stop_training",
            stop,
            task_queue=node_task_queue(node.node_id),
            schedule_to_close_timeout=STOP_ORDER_TIMEOUT,
            retry_policy=RetryPolicy(maximum_attempts=1),
        )
        order.add_done_callback(observe)


def observe(handle: asyncio.Future) -> None:
    """Retrieve an abandoned activity's outcome, so it is not reported as never retrieved."""
    if not handle.cancelled():
        handle.exception()


# The node agent's error type for a rank script that failed before its first step
# (trainer.entry): the user's mistake, not a node's.
USER_CODE_ERROR = "UserCodeError"
# ...and for a node at fault by its own word: its health check failed, or its device said it is
# broken (trainer.platform_faults). The run reports it and moves on without it.
NODE_UNHEALTHY = "NodeUnhealthy"


def user_code_failure(handles: list[workflow.ActivityHandle]) -> ApplicationError | None:
    """The first node's report that the user's training code failed before it trained, as the
    run's own non-retryable error; None when every failure is a node's or the platform's."""
    for handle in handles:
        err = handle.exception() if handle.done() else None
        cause = err.cause if isinstance(err, ActivityError) else None
        if isinstance(cause, ApplicationError) and cause.type == USER_CODE_ERROR:
            return ApplicationError(cause.message, type=USER_CODE_ERROR, non_retryable=True)
    return None


def _is_cancel(err: BaseException) -> bool:
    return isinstance(err, ActivityError) and isinstance(err.cause, CancelledError)


def _failed_its_check(err: BaseException) -> bool:
    cause = err.cause if isinstance(err, ActivityError) else None
    return isinstance(cause, ApplicationError) and cause.type == NODE_UNHEALTHY


def _node_is_suspect(err: BaseException) -> bool:
    """A node that stopped heartbeating or never picked up its work is presumed dead; one whose
    own health check failed says so."""
    return _failed_its_check(err) or _timed_out(err)


def _timed_out(err: BaseException | None) -> bool:
    """The activity stopped heartbeating or was never picked up."""
    cause = err.cause if isinstance(err, ActivityError) else None
    return isinstance(cause, TimeoutError) and cause.type in (
        TimeoutType.HEARTBEAT,
        TimeoutType.SCHEDULE_TO_START,
    )


def describe(err: BaseException) -> str:
    """The innermost message of a chain of Temporal failures, which is the one that explains."""
    message = str(err)
    cause = err.__cause__
    while cause is not None:
        message = str(cause) or message
        cause = cause.__cause__
    return message
