"""The `Cluster` entity workflow: one per cluster, it owns every node and every allocation.

Node agents register by signal; training runs ask for gangs, release them, report failed nodes
and committed checkpoints by signal; grants and preemption notices go back to the runs as
signals. Operators change the configuration and drain nodes by update. After every change (and
at least once a minute, for aging, usage decay and deadlines) one pure scheduling pass decides
grants, preemptions, the head-of-line reservation and the spare pool. Everything is keyed by
generation: a release, report or checkpoint naming an older generation than the allocation's is
stale and ignored.
"""

from __future__ import annotations

import asyncio
import contextlib
from datetime import datetime, timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError

with workflow.unsafe.imports_passed_through():
    from workflows.contracts.cluster_models import (
        Admin,
        Allocation,
        CheckpointCommitted,
        ClusterConfig,
        ClusterState,
        GangRequest,
        Health,
        JoinRequest,
        Node,
        NodeAdmin,
        NodeAnswered,
        NodeFailure,
        NodeHealthReport,
        NodeInfo,
        NodeReport,
        Release,
        WarmInput,
    )
    from workflows.contracts.names import GANG_GRANTED_SIGNAL, node_task_queue
    from workflows.scheduling import cluster_ops as ops
    from workflows.scheduling import hot_pool, node_reports
    from workflows.scheduling.cluster_ops import REVOKE_MARGIN
    from workflows.scheduling.policy_switches import Switches

_TICK = timedelta(seconds=60)


@workflow.defn(name="Cluster")
class ClusterWorkflow:
    @workflow.init
    def __init__(self, state: ClusterState | None = None) -> None:
        self._state = state or ClusterState()
        self._outbox: list[tuple[str, str, object]] = []  # (run id, signal, argument)
        self._dirty = True
        self._warming: set[asyncio.Future[None]] = set()  # the hot pool's fetches in flight

    @workflow.run
    async def run(self, state: ClusterState | None = None) -> None:
        while True:
            with contextlib.suppress(asyncio.TimeoutError):  # a tick: aging, decay, deadlines
                await workflow.wait_condition(
                    lambda: self._dirty or bool(self._outbox) or self._should_continue_as_new(),
                    timeout=self._until_next_deadline(),
                )
            self._dirty = False
            self._pass(workflow.now())
            self._warm_hot_models(workflow.now())
            while self._outbox:
                run_id, signal, argument = self._outbox.pop(0)
                await self._send(run_id, signal, argument)
            if self._should_continue_as_new():
                await workflow.wait_condition(workflow.all_handlers_finished)
                # The next run starts bounded even from a state this one inherited unbounded:
                # nothing of this run reads the state after its last command.
                ops.bound_cached(self._state)
                # Fetches in flight are this run's activities: the next plans them again.
                self._state.warming = {}
                workflow.continue_as_new(self._state)

    def _should_continue_as_new(self) -> bool:
        return workflow.info().is_continue_as_new_suggested()

    def _until_next_deadline(self) -> timedelta:
        now = workflow.now()
        deadlines = [
            a.preempting.deadline + REVOKE_MARGIN for a in self._state.allocations if a.preempting
        ]
        soonest = min(deadlines, default=now + _TICK)
        return max(timedelta(seconds=1), min(_TICK, soonest - now))

    # --- signals from node agents and runs --------------------------------------------------

    @workflow.signal
    def register_node(self, info: NodeInfo) -> None:
        """Agents before `join_node` (kept: recorded histories hold it). A signal cannot be
        refused, so one that would take a live node from its agent is dropped: the same rule
        as `join_node`'s validator, without the successor's word (a signal has none). Patched:
        before, it replaced the live node, and histories from then replay so."""
        node = self._node(info.node_id)
        held = node is not None and _held_by_another(node, info.incarnation, None)
        if held and workflow.patched("register-keeps-live-node"):
            workflow.logger.warning(
                "register_node for %s dropped: it is alive under another agent; an agent "
                "takes over a live node with join_node, naming the incarnation it follows",
                info.node_id,
            )
            return
        self._register(info)

    @workflow.update
    def join_node(self, join: JoinRequest) -> Node:
        """An agent joins, or says again what it holds (a new cached snapshot)."""
        self._register(join.info)
        node = self._node(join.info.node_id)
        assert node is not None  # registered just now
        return node

    @join_node.validator
    def _not_a_live_node_of_another_agent(self, join: JoinRequest) -> None:
        # Refused in the validator: nothing reaches the history, and the live node is untouched.
        node = self._node(join.info.node_id)
        if node is None or not _held_by_another(
            node, join.info.incarnation, join.previous_incarnation
        ):
            return  # a new node, a down one, this agent again, or its successor on the same host
        raise ApplicationError(
            f"node {join.info.node_id} is alive under another agent (at {node.info.host}, "
            f"{node.state}): give this agent its own --node-id, or stop that agent first",
            non_retryable=True,
        )

    def _register(self, info: NodeInfo) -> None:
        # Patched: the bound can change which nodes a pass prefers for a run, hence what a
        # grant says, and a replay of a run from before it must choose as that run did.
        if workflow.patched("bounded-cached"):
            info = ops.bounded(info)
        node = self._node(info.node_id)
        if node is None:
            self._state.nodes.append(Node(info=info))
        else:
            restarted = node.info.incarnation != info.incarnation
            node.info = info
            # A restarted agent that was down is healthy again; the GPUs its old gangs hold
            # stay held until those runs release them, so nothing is ever booked twice.
            if restarted and node.health == Health.DOWN:
                node.health = Health.HEALTHY
                node.down_reason = None
        self._dirty = True

    @workflow.signal
    def node_stopped(self, info: NodeInfo) -> None:
        """The agent is shutting down: its node takes no new work until it registers again."""
        node = self._node(info.node_id)
        if node is not None and node.info.incarnation == info.incarnation:
            node.health = Health.DOWN
            node.down_reason = "agent stopped"
            self._dirty = True

    @workflow.signal
    def request_gang(self, request: GangRequest) -> None:
        held = self._allocation(request.run_id)
        if held is not None:
            # The run asked again (e.g. its workflow task was retried): resend what it holds.
            self._outbox.append((held.run_id, GANG_GRANTED_SIGNAL, held))
            return
        self._enqueue(request)

    def _enqueue(self, request: GangRequest) -> None:
        if all(r.run_id != request.run_id for r in self._state.queue):
            if request.submitted_at is None:
                request = request.model_copy(update={"submitted_at": workflow.now()})
            # Patched: a requeued run's deadline counts from here; histories from before gave it
            # none, and replay under the policy they were recorded with.
            if request.started_before and workflow.patched("requeue-deadline"):
                request = request.model_copy(update={"waiting_since": workflow.now()})
            # Counted with the pool off too: turned on, it starts from what is asked for.
            hot_pool.record_demand(self._state, request, workflow.now())
            self._state.queue.append(request)
            self._dirty = True

    @workflow.signal
    def release(self, release: Release) -> None:
        self._state.queue = [r for r in self._state.queue if r.run_id != release.run_id]
        held = self._allocation(release.run_id)
        if held is not None and held.generation == release.generation:
            self._free(held)
        if release.requeue is not None:
            self._enqueue(release.requeue)
        self._dirty = True

    @workflow.signal
    def report_failure(self, failure: NodeFailure) -> None:
        node = self._node(failure.node_id)
        held = self._allocation(failure.run_id)
        if node is None or held is None or held.generation != failure.generation:
            return
        granted = next((n for n in held.nodes if n.node_id == failure.node_id), None)
        if failure.kind in node_reports.RANK_REPORTED and workflow.patched("cordon-corroborated"):
            self._reported(node, failure, held, granted)
            return
        if failure.kind == "unhealthy":
            # The node's own check failed: out of service until the check passes again (its
            # agent says so, see node_health), not a death.
            if node.health_reason is None:
                node.health_reason = failure.reason
                node.health = Health.DOWN
                node.down_reason = failure.reason
                self._dirty = True
            return
        if failure.kind == "fail-stop":
            if granted is not None and granted.incarnation != node.info.incarnation:
                # The agent was restarted (the node repaired) before the run noticed: the
                # death is on record, the node as it is now is not the one that died.
                self._state.fail_stops += 1
                self._dirty = True
                return
            if node.health == Health.HEALTHY:  # each death once, however many runs report it
                self._state.fail_stops += 1
            node.health = Health.DOWN
        else:
            node.admin = Admin.CORDONED
        node.down_reason = failure.reason
        self._dirty = True

    @workflow.signal
    def node_answered(self, found: NodeAnswered) -> None:
        """A node a run reported dead answered its probe after all (`NodeAnswered`). Only
        that report is undone: the node is back if it is still down for exactly that reason,
        as the same incarnation, with its own health check passing; its death is not counted.
        Down for anything since (another run's report, its check failing, its agent stopped),
        it stays down."""
        node = self._node(found.node_id)
        if (
            node is None
            or node.info.incarnation != found.incarnation
            or node.health != Health.DOWN
            or node.down_reason != found.reason
            or node.health_reason is not None
        ):
            return
        node.health = Health.HEALTHY
        node.down_reason = None
        self._state.fail_stops = max(0, self._state.fail_stops - 1)
        self._dirty = True

    def _reported(
        self, node: Node, failure: NodeFailure, held: Allocation, granted: NodeInfo | None
    ) -> None:
        """A run's ranks named the node (a straggler, silent corruption): recorded on it, and
        cordoned once runs of enough teams did (node_reports). Runs from before cordoned it on
        any one run's word. A node that is not the run's own is none of its business."""
        if granted is None:
            return
        report = NodeReport(
            run_id=failure.run_id, team=held.team, kind=failure.kind, reason=failure.reason,
            at=workflow.now(),
        )  # fmt: skip
        evidence = node_reports.reported(node, report, self._state.config)
        if evidence is not None:
            node.admin = Admin.CORDONED
            node.down_reason = node_reports.cordon_reason(evidence, self._state.config)
        self._dirty = True

    @workflow.signal
    def node_health(self, report: NodeHealthReport) -> None:
        """The node's own check: failing takes it out of service; passing again brings it back,
        unless it is down for another reason (it died under a gang: its agent must restart)."""
        node = self._node(report.node_id)
        if node is None or node.info.incarnation != report.incarnation:
            return
        if not report.healthy:
            node.health = Health.DOWN
            node.down_reason = report.reason
        elif node.health == Health.DOWN and node.down_reason == node.health_reason:
            node.health = Health.HEALTHY
            node.down_reason = None
        node.health_reason = None if report.healthy else report.reason
        self._dirty = True

    @workflow.signal
    def checkpoint_committed(self, committed: CheckpointCommitted) -> None:
        held = self._allocation(committed.run_id)
        if held is not None and held.generation == committed.generation:
            held.last_checkpoint_at = workflow.now()

    # --- operators ---------------------------------------------------------------------------

    @workflow.update
    def apply_config(self, config: ClusterConfig) -> ClusterConfig:
        self._state.config = config
        self._dirty = True
        return config

    @workflow.update
    def set_node_admin(self, change: NodeAdmin) -> Node:
        node = self._node(change.node_id)
        assert node is not None  # the validator refused unknown nodes
        node.admin = change.admin
        if change.admin == Admin.ACTIVE:  # an operator looked at it: the reports are answered
            node.reports = []
        self._dirty = True
        return node

    @set_node_admin.validator
    def _known_node(self, change: NodeAdmin) -> None:
        if self._node(change.node_id) is None:
            known = ", ".join(sorted(n.info.node_id for n in self._state.nodes)) or "none"
            raise ApplicationError(f"no node {change.node_id!r} (known: {known})")

    @workflow.query
    def state(self) -> ClusterState:
        return self._state

    # --- internals ---------------------------------------------------------------------------

    def _node(self, node_id: str) -> Node | None:
        return ops.node(self._state, node_id)

    def _allocation(self, run_id: str) -> Allocation | None:
        return ops.allocation_of(self._state, run_id)

    def _free(self, allocation: Allocation) -> None:
        ops.free(self._state, allocation, workflow.now())

    def _pass(self, now: datetime) -> None:
        # Patched: the starvation guard changes what a pass grants, reserves and preempts, so a
        # history recorded before it replays only under the policy it was recorded with.
        guard = workflow.patched("starvation-guard")
        deadline = guard and workflow.patched("start-deadline")
        yielding = deadline and workflow.patched("yielding-backfill")
        switches = Switches(
            starvation_guard=guard,
            start_deadline=deadline,
            yielding_backfill=yielding,
            yield_latest_first=yielding and workflow.patched("yield-latest-first"),
            spares_off_reservations=guard and workflow.patched("spares-off-reservations"),
            reclaim_patience=workflow.patched("reclaim-patience"),
        )
        revoked, _, messages = ops.run_pass(self._state, now, switches)
        for allocation in revoked:
            # Its generation is retired, so anything it still sends is ignored.
            workflow.logger.warning("revoked %s: grace period over", allocation.run_id)
        self._outbox.extend(messages)

    def _warm_hot_models(self, now: datetime) -> None:
        """Tell idle nodes to fetch the hot base models short of holders (`hot_pool`). Each
        fetch runs on its node as an activity the loop does not wait for; the node says what it
        holds when done (it joins again), and a fetch that fails is planned again later."""
        # Patched: a pass of a history from before the pool starts no activity.
        if not hot_pool.on(self._state) or not workflow.patched("hot-pool"):
            return
        plan = hot_pool.warm_plan(self._state, now)
        hot = sorted(hot_pool.targets(self._state, now))
        for warm in plan:
            workflow.logger.info("warming %s on %s", warm.item, warm.node_id)
            fetch = asyncio.ensure_future(self._warm(warm, hot))
            self._warming.add(fetch)  # held until done: a task nothing refers to may vanish
            fetch.add_done_callback(self._warming.discard)

    async def _warm(self, warm: hot_pool.Warm, hot: list[str]) -> None:
        try:
            await workflow.execute_activity(
                "warm_cache",
                WarmInput(manifest_key=warm.manifest_key, hot=hot),
                task_queue=node_task_queue(warm.node_id),
                start_to_close_timeout=hot_pool.WARM_TIMEOUT,
                heartbeat_timeout=timedelta(minutes=2),
                retry_policy=RetryPolicy(maximum_attempts=1),
            )
        except ActivityError as err:
            workflow.logger.warning("warming %s on %s failed: %s", warm.item, warm.node_id, err)
        finally:
            held = self._state.warming.get(warm.node_id)
            if held is not None and held.item == warm.item:
                del self._state.warming[warm.node_id]
            self._dirty = True

    async def _send(self, run_id: str, signal: str, argument: object) -> None:
        try:
            await workflow.get_external_workflow_handle(run_id).signal(signal, argument)
        except Exception as err:  # the run is gone (terminated, deleted): take its nodes back
            workflow.logger.warning("signal %s to %s failed (%s)", signal, run_id, err)
            held = self._allocation(run_id)
            if held is not None:
                self._free(held)
                self._dirty = True


def _held_by_another(node: Node, incarnation: str, previous: str | None) -> bool:
    """Whether `node` is alive under an agent other than the one of `incarnation` (or its
    successor, which names the incarnation `previous` it follows): a down node may be taken
    by any agent."""
    return node.health != Health.DOWN and node.info.incarnation not in (incarnation, previous)
