"""A small discrete-event simulator over the pure scheduling policy (no Temporal).

It drives the policy through `workflows.scheduling.cluster_ops`, the
functions the `Cluster` workflow calls
(revoke victims past their grace, decay usage, schedule, apply; a pass after every change and at
least every tick while anything waits), and plays the runs' side: a granted gang runs for a
random time within its max runtime, then releases; a preempted one checkpoints and releases
within the grace period (or never: the revoke path frees it) and queues again with its original
age; a gang on a failed node releases and queues again as a recovery request after a short
backoff. Seeded: a run is a pure
function of its inputs. Every transition is recorded in `log`.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta

from tests.workflows.scheduling.policy_fixtures import NOW
from workflows.contracts.cluster_models import (
    Admin,
    Allocation,
    ClusterState,
    GangRequest,
    Health,
    Node,
)
from workflows.contracts.names import GANG_GRANTED_SIGNAL, PREEMPT_SIGNAL
from workflows.scheduling import cluster_ops as ops
from workflows.scheduling.cluster_ops import REVOKE_MARGIN
from workflows.scheduling.scheduler import Decisions, schedule

# The Cluster workflow's timing (workflows/cluster.py): a pass at least every minute while work
# waits, and a victim is revoked once its deadline is this far behind.
TICK = timedelta(seconds=60)


@dataclass(frozen=True)
class Arrival:
    at_s: float  # seconds after the simulation starts
    request: GangRequest


@dataclass(frozen=True)
class NodeEvent:
    at_s: float
    node_id: str
    change: str  # "down", "up", or an Admin value ("active", "cordoned", "draining")


@dataclass(frozen=True)
class Transition:
    at: datetime
    kind: str  # submit, grant, preempt, release (done, preempted, node failed), revoke, node
    run_id: str = ""
    generation: int = 0
    nodes: tuple[str, ...] = ()
    detail: str = ""


class Simulator:
    def __init__(
        self,
        state: ClusterState,
        arrivals: Iterable[Arrival] = (),
        node_events: Iterable[NodeEvent] = (),
        *,
        seed: int = 0,
        start: datetime = NOW,
        never_release: float = 0.0,  # chance that a victim ignores its notice
        requeue_preempted: bool = True,  # False: a preempted run gives up instead of queueing
        min_run_fraction: float = 0.1,  # a run lasts this much of its max runtime, at least
        on_decisions: Callable[[ClusterState, Decisions, datetime], None] | None = None,
        after_pass: Callable[[Simulator], None] | None = None,
    ) -> None:
        self.state = state
        self.now = start
        self.rng = random.Random(seed)
        self.never_release = never_release
        self.requeue_preempted = requeue_preempted
        self.min_run_fraction = min_run_fraction
        self.on_decisions = on_decisions  # sees the state schedule() saw, before it changes
        self.after_pass = after_pass
        self.log: list[Transition] = []
        self.passes = 0
        self.last_decisions = Decisions()
        self._events: list[tuple[datetime, int, str, object]] = []
        self._seq = itertools.count()  # ties break by insertion: the heap never compares payloads
        # What each run asks for when it queues again (allocations present at the start are
        # taken to have been asked for when they were granted).
        self.requests: dict[str, GangRequest] = {
            a.run_id: GangRequest(
                run_id=a.run_id, nodes=len(a.nodes), gpus_per_node=a.gpus_per_node, team=a.team,
                priority=a.priority, preemptible=a.preemptible, submitted_at=a.granted_at,
            )
            for a in state.allocations
        }  # fmt: skip
        for request in state.queue:
            self.requests[request.run_id] = request
        for allocation in state.allocations:  # what runs at the start ends by its max runtime
            end = allocation.expected_end or start + TICK
            release = (allocation.run_id, allocation.generation, False)
            self._push(max(start, end), "release", release)
        for arrival in arrivals:
            self._push(start + timedelta(seconds=arrival.at_s), "arrive", arrival.request)
        for event in node_events:
            self._push(start + timedelta(seconds=event.at_s), "node", event)

    # --- driving -----------------------------------------------------------------------------

    def run(self, until: datetime, stop: Callable[[Simulator], bool] | None = None) -> None:
        """Process events and passes until `until`, `stop` says so, or nothing can change."""
        while True:
            while self._events and self._events[0][0] <= self.now:
                _, _, kind, payload = heapq.heappop(self._events)
                self._handle(kind, payload)
            self._pass()
            if stop is not None and stop(self):
                return
            wakeup = self._next_wakeup()
            if wakeup is None or wakeup > until:
                return
            self.now = wakeup

    def quiescent(self) -> bool:
        """Nothing runs and nothing will happen: what still waits can never be placed."""
        return not self._events and not self.state.allocations

    def granted_at(self, run_id: str) -> datetime | None:
        return next((t.at for t in self.log if t.kind == "grant" and t.run_id == run_id), None)

    def _next_wakeup(self) -> datetime | None:
        state = self.state
        candidates = [self._events[0][0]] if self._events else []
        # Ticks only matter while something waits or a deadline runs: a pass over an empty queue
        # grants nothing (events, which do trigger passes, cover everything else).
        if state.queue or any(a.preempting for a in state.allocations):
            deadlines = [
                a.preempting.deadline + REVOKE_MARGIN for a in state.allocations if a.preempting
            ]
            soonest = min(deadlines, default=self.now + TICK)
            candidates.append(self.now + max(timedelta(seconds=1), min(TICK, soonest - self.now)))
        return min(candidates, default=None)

    def _push(self, at: datetime, kind: str, payload: object) -> None:
        heapq.heappush(self._events, (at, next(self._seq), kind, payload))

    def _record(self, kind: str, run_id: str = "", generation: int = 0, **fields: object) -> None:
        self.log.append(Transition(self.now, kind, run_id, generation, **fields))

    # --- the runs' and the operators' side ---------------------------------------------------

    def _handle(self, kind: str, payload: object) -> None:
        if kind == "arrive":
            assert isinstance(payload, GangRequest)
            self._request(payload)
        elif kind == "release":
            run_id, generation, requeue = payload  # type: ignore[misc]
            held = self._allocation(run_id)
            if held is None or held.generation != generation:
                return  # this attempt of the run is already over (revoked, failed, done)
            self._release(held, "preempted" if requeue else "done")
            if requeue and self.requeue_preempted:
                self._request(self._again(run_id))  # straight back, with its original age
        elif kind == "node":
            assert isinstance(payload, NodeEvent)
            self._node_event(payload)

    def _request(self, request: GangRequest) -> None:
        """As the `request_gang` signal: a run that holds a gang or already waits is ignored."""
        state = self.state
        if self._allocation(request.run_id) or any(r.run_id == request.run_id for r in state.queue):
            return
        if request.submitted_at is None:
            request = request.model_copy(update={"submitted_at": self.now})
        self.requests[request.run_id] = request
        state.queue.append(request)
        self._record("submit", request.run_id)

    def _again(self, run_id: str, recovery: bool = False) -> GangRequest:
        """The run's request once it has run: requeued, as the training run asks again."""
        update: dict[str, bool] = {"started_before": True}
        if recovery:
            update["recovery"] = True
        self.requests[run_id] = self.requests[run_id].model_copy(update=update)
        return self.requests[run_id]

    def _release(self, allocation: Allocation, why: str) -> None:
        """As the `release` signal of the allocation's own generation."""
        self.state.queue = [r for r in self.state.queue if r.run_id != allocation.run_id]
        self._free(allocation)
        self._record("release", allocation.run_id, allocation.generation, detail=why)

    def _node_event(self, event: NodeEvent) -> None:
        node = self._node(event.node_id)
        if event.change == "down":
            node.health = Health.DOWN
            node.down_reason = "simulated failure"
            # Each run on it reports the failure, gives its gang back and, after a backoff, asks
            # again as a recovery request (which may take a spare).
            for held in [a for a in self.state.allocations if event.node_id in _ids(a)]:
                self._release(held, f"node {event.node_id} failed")
                retry = self._again(held.run_id, recovery=True)
                self._push(self.now + timedelta(seconds=self.rng.uniform(1, 30)), "arrive", retry)
        elif event.change == "up":
            node.health = Health.HEALTHY
            node.down_reason = None
        else:
            node.admin = Admin(event.change)
        self._record("node", detail=f"{event.node_id} {event.change}")

    # --- the Cluster workflow's side (ClusterWorkflow._pass, _apply, _free) -------------------

    def _node(self, node_id: str) -> Node:
        return next(n for n in self.state.nodes if n.info.node_id == node_id)

    def _allocation(self, run_id: str) -> Allocation | None:
        return next((a for a in self.state.allocations if a.run_id == run_id), None)

    def _free(self, allocation: Allocation) -> None:
        ops.free(self.state, allocation, self.now)

    def _pass(self) -> None:
        # The workflow's `run_pass` is prepare + schedule + apply; the hook sits between.
        state, now = self.state, self.now
        self.passes += 1
        for allocation in ops.prepare(state, now):
            self._record("revoke", allocation.run_id, allocation.generation)
            # The run learns it lost its gang later and asks again, keeping its age.
            if self.requeue_preempted:
                self._push(now + timedelta(seconds=1), "arrive", self._again(allocation.run_id))
        decisions = schedule(state, now)
        self.last_decisions = decisions
        if self.on_decisions is not None:
            self.on_decisions(state, decisions, now)
        self._react(ops.apply(state, decisions, now), now)
        if self.after_pass is not None:
            self.after_pass(self)

    def _react(self, messages: list[ops.Message], now: datetime) -> None:
        """What the runs do with the Cluster's signals: train then release, or get preempted."""
        default_runtime_s = self.state.config.default_max_runtime_h * 3600
        for run_id, signal, argument in messages:
            if signal == GANG_GRANTED_SIGNAL:
                allocation = argument
                request = self.requests[run_id]
                nodes = tuple(n.node_id for n in allocation.nodes)
                self._record("grant", run_id, allocation.generation, nodes=nodes)
                # The run trains for a while within its max runtime, then gives the gang back.
                limit_s = request.max_runtime_s or default_runtime_s
                run_s = max(1.0, self.rng.uniform(self.min_run_fraction, 1.0) * limit_s)
                end = min(now + timedelta(seconds=run_s), allocation.expected_end)
                self._push(end, "release", (run_id, allocation.generation, False))
            elif signal == PREEMPT_SIGNAL:
                notice = argument
                victim = self._allocation(run_id)
                detail = victim.preempting.reason if victim and victim.preempting else ""
                self._record("preempt", run_id, notice.generation, detail=detail)
                if self.rng.random() >= self.never_release:
                    at = now + timedelta(seconds=self.rng.uniform(0, notice.grace_s))
                    self._push(at, "release", (run_id, notice.generation, True))


def _ids(allocation: Allocation) -> set[str]:
    return {n.node_id for n in allocation.nodes}
