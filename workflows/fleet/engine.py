"""The discrete-event engine: jobs and node failures against the real scheduling policy.

The cluster's side is `workflows.cluster_ops` (prepare, `schedule`, apply; `free` on release),
exactly what the `Cluster` workflow runs; this module plays the rest: the runs (train in
checkpointed periods, save and release on a preemption notice, lose the work since the last
save and ask again as a recovery request when a node of their gang dies) and the nodes (fail,
get repaired). Passes are batched: at most one per tick, and only after something changed (an
arrival, a release, a failure, a repair): the workflow passes on every signal and each minute,
but between two ticks nothing but time moves, and a pass over thousands of nodes is the cost.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from workflows import cluster_ops as ops
from workflows.cluster_models import Allocation, ClusterState, GangRequest, Health, Node, NodeInfo
from workflows.fleet.config import POLICIES, SimConfig
from workflows.fleet.progress import Attempt
from workflows.fleet.workload import DAY, Job, Outage
from workflows.names import GANG_GRANTED_SIGNAL, PREEMPT_SIGNAL
from workflows.scheduler import schedule

START = datetime(2026, 1, 5, tzinfo=UTC)  # a Monday; only differences matter
IntervalRule = Callable[[float, float], float]  # (save s, gang MTBF s) -> checkpoint interval s


@dataclass
class JobRecord:
    """What happened to one job: the report is made of these."""

    job: Job
    kept_s: float = 0.0  # work committed (or done, for the last attempt) so far
    first_grant_s: float | None = None
    finished_s: float | None = None
    allocated_gpu_s: float = 0.0
    attempts: int = 0
    failures: int = 0
    preemptions: int = 0
    spare_hits: int = 0
    interval_s: float = 0.0


@dataclass
class Trace:
    """GPU-seconds per bin of time: what the utilisation plot and the measured window use."""

    bin_s: float
    allocated: list[float]
    useful: list[float]
    healthy: list[float]

    def spread(self, series: list[float], start: float, end: float, gpu_s: float) -> None:
        """Add `gpu_s`, spent evenly over [start, end), to the bins it covers."""
        if end <= start:
            return
        rate = gpu_s / (end - start)
        first = int(start // self.bin_s)
        last = int(min(end, len(series) * self.bin_s) // self.bin_s)
        for b in range(first, min(last, len(series) - 1) + 1):
            lo, hi = max(start, b * self.bin_s), min(end, (b + 1) * self.bin_s)
            if hi > lo:
                series[b] += rate * (hi - lo)


@dataclass
class Outcome:
    config: SimConfig
    records: dict[str, JobRecord]
    trace: Trace
    passes: int = 0
    preemptions: int = 0
    failures_under_jobs: int = 0
    recoveries: int = 0
    spare_hits: int = 0
    max_queue: int = 0
    still_waiting: list[str] = field(default_factory=list)


class Simulation:
    def __init__(
        self,
        config: SimConfig,
        jobs: list[Job],
        outages: list[Outage],
        interval: IntervalRule | None = None,
    ) -> None:
        self.config = config
        self.policy = POLICIES[config.policy]
        self.interval = interval
        fleet = config.fleet
        self.horizon = config.days * DAY
        self.state = ClusterState(config=config.cluster_config(self.policy), nodes=self._nodes())
        self.nodes: list[Node] = self.state.nodes
        self.by_id = {n.info.node_id: i for i, n in enumerate(self.nodes)}
        bins = int(self.horizon // 3600) + 1
        self.trace = Trace(3600.0, [0.0] * bins, [0.0] * bins, [0.0] * bins)
        self.trace.spread(self.trace.healthy, 0.0, self.horizon, config.gpus * self.horizon)
        self.out = Outcome(config, {j.run_id: JobRecord(j) for j in jobs}, self.trace)
        self.attempts: dict[str, tuple[Attempt, int]] = {}  # run id -> (attempt, generation)
        self.recovering: set[str] = set()  # failed, asking again: a spare may serve them
        self.now_s = 0.0
        self.dirty = False
        self._events: list[tuple[float, int, str, object]] = []
        self._seq = itertools.count()
        for job in jobs:
            self._push(job.submit_s, "arrive", (job.run_id, False))
        for outage in outages:
            self._push(outage.down_s, "down", outage.node)
            self._push(min(outage.up_s, self.horizon), "up", outage.node)
            self.trace.spread(
                self.trace.healthy,
                outage.down_s,
                min(outage.up_s, self.horizon),
                -fleet.gpus_per_node * (min(outage.up_s, self.horizon) - outage.down_s),
            )

    def _nodes(self) -> list[Node]:
        fleet = self.config.fleet
        return [
            Node(
                info=NodeInfo(
                    node_id=f"n{i:05d}",
                    gpus=fleet.gpus_per_node,
                    gpu_type="h100",
                    pod=f"pod{i // fleet.pod_size:03d}",
                    rdzv_port=29_500,
                    incarnation="sim",
                )
            )
            for i in range(fleet.nodes)
        ]

    # --- driving -----------------------------------------------------------------------------

    def run(self) -> Outcome:
        tick = self.config.tick_s
        while self._events and self._events[0][0] < self.horizon:
            at = self._events[0][0]
            # Everything up to the next tick happens, then one pass sees it all.
            self.now_s = min(self.horizon, (at // tick + 1) * tick)
            while self._events and self._events[0][0] < self.now_s:
                event_s, _, kind, payload = heapq.heappop(self._events)
                self._handle(event_s, kind, payload)
            if self.dirty:
                self._pass()
        self._close()
        return self.out

    def _push(self, at: float, kind: str, payload: object) -> None:
        heapq.heappush(self._events, (at, next(self._seq), kind, payload))

    def _at(self, seconds: float) -> datetime:
        return START + timedelta(seconds=seconds)

    def _handle(self, at: float, kind: str, payload: object) -> None:
        if kind == "arrive":
            run_id, recovery = payload  # type: ignore[misc]
            self._request(self.out.records[run_id], recovery, at)
        elif kind == "end":
            run_id, generation = payload  # type: ignore[misc]
            self._end(run_id, generation, at, finished=True)
        elif kind == "release":  # after a preemption notice: saved (or not), gives back
            run_id, generation, kept = payload  # type: ignore[misc]
            if self._end(run_id, generation, at, kept=kept):
                self._request(self.out.records[run_id], False, at)
        elif kind == "down":
            self._down(payload, at)  # type: ignore[arg-type]
        elif kind == "up":
            node = self.nodes[payload]  # type: ignore[index]
            node.health, node.down_reason = Health.HEALTHY, None
            self.dirty = True

    # --- the runs' side ----------------------------------------------------------------------

    def _request(self, record: JobRecord, recovery: bool, at: float) -> None:
        """As the `request_gang` signal; a requeued run keeps its first submission time."""
        job = record.job
        nodes, per_node = self._shape(job.gpus)
        attempt = self._attempt(record, at)
        expected = attempt.end - attempt.granted
        self.state.queue.append(
            GangRequest(
                run_id=job.run_id,
                nodes=nodes,
                gpus_per_node=per_node,
                team=job.team,
                priority=job.priority,
                max_runtime_s=expected * self.config.runtime_estimate,
                recovery=recovery,
                submitted_at=self._at(job.submit_s),
            )
        )
        self.out.max_queue = max(self.out.max_queue, len(self.state.queue))
        self.dirty = True

    def _shape(self, gpus: int) -> tuple[int, int]:
        per_node = self.config.fleet.gpus_per_node
        return (1, gpus) if gpus <= per_node else (-(-gpus // per_node), per_node)

    def _attempt(self, record: JobRecord, granted: float) -> Attempt:
        job = record.job
        if not record.interval_s:
            nodes, _ = self._shape(job.gpus)
            mtbf_s = self.config.failures.node_mtbf_h * 3600 / nodes
            record.interval_s = (
                self.interval(job.save_s, mtbf_s)
                if self.interval is not None
                else self.config.checkpoint_interval_s
            )
        return Attempt(granted, job.restart_s, record.interval_s, job.save_s,
                       job.work_s - record.kept_s)  # fmt: skip

    def _end(
        self, run_id: str, generation: int, at: float, *, finished: bool = False, kept=None
    ) -> bool:
        """An attempt gives its gang back (done, preempted or failed); False if it is stale."""
        held = self.attempts.get(run_id)
        if held is None or held[1] != generation:
            return False
        attempt, _ = held
        del self.attempts[run_id]
        record = self.out.records[run_id]
        kept = attempt.remaining if finished else kept
        self._charge(record, attempt, at, kept)
        if finished:
            record.finished_s = at
        allocation = ops.allocation_of(self.state, run_id)
        if allocation is not None and allocation.generation == generation:
            ops.free(self.state, allocation, self._at(at))  # the `release` signal
        self.dirty = True
        return True

    def _charge(self, record: JobRecord, attempt: Attempt, at: float, kept: float) -> None:
        gpus = record.job.gpus
        record.kept_s += kept
        record.allocated_gpu_s += gpus * (at - attempt.granted)
        self.trace.spread(self.trace.allocated, attempt.granted, at, gpus * (at - attempt.granted))
        work_end = attempt.work_start + attempt.wall(kept)
        self.trace.spread(self.trace.useful, attempt.work_start, work_end, gpus * kept)

    def _down(self, index: int, at: float) -> None:
        """A node dies: every gang on it loses the work since its last save and asks again."""
        node = self.nodes[index]
        victims = list(node.jobs)
        node.health, node.down_reason = Health.DOWN, "simulated failure"
        if victims:
            self.state.fail_stops += 1
            self.out.failures_under_jobs += 1
        for run_id in victims:
            attempt, generation = self.attempts[run_id]
            self.out.records[run_id].failures += 1
            self._end(run_id, generation, at, kept=attempt.committed(at))
            backoff = self.config.failures.recovery_backoff_s
            self.recovering.add(run_id)
            self._push(at + backoff, "arrive", (run_id, True))
        self.dirty = True

    # --- the Cluster workflow's side ---------------------------------------------------------

    def _pass(self) -> None:
        state, now = self.state, self._at(self.now_s)
        self.dirty = False
        self.out.passes += 1
        if self.policy.preemption:
            self._note_checkpoints()
        spares = {n.info.node_id for n in self.nodes if n.spare}
        for allocation in ops.prepare(state, now):  # never here: victims save within grace
            raise AssertionError(f"{allocation.run_id} revoked: a victim outlived its grace")
        decisions = schedule(
            state,
            now,
            arrival_order=self.policy.arrival_order,
            backfill=self.policy.backfill,
            preemption=self.policy.preemption,
            starvation_guard=self.policy.starvation_guard,
        )
        for run_id, signal, argument in ops.apply(state, decisions, now):
            if signal == GANG_GRANTED_SIGNAL:
                self._granted(argument, spares)  # type: ignore[arg-type]
            elif signal == PREEMPT_SIGNAL:
                self._preempted(run_id)

    def _note_checkpoints(self) -> None:
        """The runs' `checkpoint_committed` signals: preemption prefers the freshest saves."""
        for allocation in self.state.allocations:
            attempt, _ = self.attempts[allocation.run_id]
            period = attempt.interval + attempt.save
            saves = int(max(0.0, self.now_s - attempt.work_start) // period)
            if saves:
                allocation.last_checkpoint_at = self._at(attempt.work_start + saves * period)

    def _granted(self, allocation: Allocation, spares: set[str]) -> None:
        record = self.out.records[allocation.run_id]
        if allocation.run_id in self.recovering:
            self.recovering.discard(allocation.run_id)
            self.out.recoveries += 1
            if any(n.node_id in spares for n in allocation.nodes):
                record.spare_hits += 1
                self.out.spare_hits += 1
        record.attempts += 1
        if record.first_grant_s is None:
            record.first_grant_s = self.now_s
        attempt = self._attempt(record, self.now_s)
        self.attempts[allocation.run_id] = (attempt, allocation.generation)
        self._push(attempt.end, "end", (allocation.run_id, allocation.generation))

    def _preempted(self, run_id: str) -> None:
        attempt, generation = self.attempts[run_id]
        record = self.out.records[run_id]
        release_s, kept = attempt.preempted(self.now_s, self.config.fleet.preemption_grace_s)
        if release_s >= attempt.end:
            return  # it finishes first; its normal release answers the notice
        record.preemptions += 1
        self.out.preemptions += 1
        self._push(release_s, "release", (run_id, generation, kept))

    def _close(self) -> None:
        """At the horizon: running attempts are charged so far (work done counts as kept)."""
        for run_id, (attempt, _) in list(self.attempts.items()):
            record = self.out.records[run_id]
            self._charge(record, attempt, self.horizon, attempt.done(self.horizon))
        self.attempts.clear()
        self.out.still_waiting = [r.run_id for r in self.state.queue]


def simulate(
    config: SimConfig, jobs: list[Job], outages: list[Outage], interval: IntervalRule | None
) -> Outcome:
    return Simulation(config, jobs, outages, interval).run()
