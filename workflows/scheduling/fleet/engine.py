"""The discrete-event engine: jobs and node failures against the real scheduling policy.

The cluster's side is `workflows.scheduling.cluster_ops` (prepare, `schedule`, apply; `free` on
release),
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
import math
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from workflows.contracts.cluster_models import (
    Allocation,
    ClusterState,
    GangRequest,
    Health,
    Node,
    NodeInfo,
)
from workflows.contracts.names import GANG_GRANTED_SIGNAL, PREEMPT_SIGNAL
from workflows.scheduling import cluster_ops as ops
from workflows.scheduling import hot_pool
from workflows.scheduling.fleet.base_models import FetchLedger, NodeCaches
from workflows.scheduling.fleet.config import POLICIES, SimConfig
from workflows.scheduling.fleet.idle import IdleLedger
from workflows.scheduling.fleet.progress import Attempt, IntervalRule, SavePlan, save_plan
from workflows.scheduling.fleet.workload import DAY, Job, Outage, base_sizes_gb
from workflows.scheduling.scheduler import schedule

START = datetime(2026, 1, 5, tzinfo=UTC)  # a Monday; only differences matter


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
    failed_in_row: int = 0  # failed attempts since the last that committed anything
    asked_again_s: float | None = None  # when it last asked for a gang to recover on
    recovery_wait_s: float = 0.0  # from asking again after a failure to the new gang
    requeued_s: float | None = None  # when it last queued again after running
    longest_requeued_wait_s: float = 0.0  # of its waits after running (failures, preemptions)
    shrunk: int = 0  # attempts on fewer nodes than asked (elastic)
    regrown: int = 0  # of those, stopped to grow back
    plan: SavePlan | None = None
    # Set by a preemption until the next grant, which pays its restart again: True if the
    # preemption was a yielder leaving as agreed.
    restart_owed_by_yielder: bool | None = None


@dataclass
class PreemptionCost:
    """GPU-seconds that preemptions cost, yielders leaving as agreed apart from the rest: the
    work a notice threw away (none when the save fits the grace period), the gang's GPUs held
    while it saved, and the restart its next attempt paid again. A count of preemptions weighs
    an 8-GPU yielder that saved in a minute like a 1,024-GPU run that lost an hour; this does
    not."""

    yielders: float = 0.0
    others: float = 0.0

    def add(self, by_yielder: bool, gpu_s: float) -> None:
        if by_yielder:
            self.yielders += gpu_s
        else:
            self.others += gpu_s


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
    yielded: int = 0  # of the preemptions, yielders leaving a reservation's nodes as agreed
    failures_under_jobs: int = 0
    recoveries: int = 0
    spare_hits: int = 0
    max_queue: int = 0
    still_waiting: list[str] = field(default_factory=list)
    idle: IdleLedger = field(default_factory=lambda: IdleLedger(0.0))
    preemption_cost: PreemptionCost = field(default_factory=PreemptionCost)
    fetches: FetchLedger | None = None  # with fine-tunes in the workload


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
        self.switches = self.policy.switches
        self.interval = interval
        fleet = config.fleet
        self.horizon = config.days * DAY
        self.state = ClusterState(config=config.cluster_config(self.policy), nodes=self._nodes())
        self.nodes: list[Node] = self.state.nodes
        self.by_id = {n.info.node_id: i for i, n in enumerate(self.nodes)}
        bins = int(self.horizon // 3600) + 1
        self.trace = Trace(3600.0, [0.0] * bins, [0.0] * bins, [0.0] * bins)
        self.trace.spread(self.trace.healthy, 0.0, self.horizon, config.gpus * self.horizon)
        self.out = Outcome(
            config,
            {j.run_id: JobRecord(j) for j in jobs},
            self.trace,
            idle=IdleLedger(measured_from_s=config.warmup_days * DAY),
        )
        self.attempts: dict[str, tuple[Attempt, int]] = {}  # run id -> (attempt, generation)
        self.recovering: set[str] = set()  # failed, asking again: a spare may serve them
        self.failing: set[tuple[str, int]] = set()  # (run, generation): dead node not noticed
        self.growing: set[str] = set()  # shrunk gangs that stopped to have their full size back
        # Base models on the nodes, when the workload has fine-tunes.
        self.caches: NodeCaches | None = None
        if any(job.base is not None for job in jobs):
            self.caches = NodeCaches(self.nodes, config.base_models, base_sizes_gb(config))
            self.out.fetches = self.caches.ledger
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
            if (run_id, generation) not in self.failing:
                self._end(run_id, generation, at, finished=True)
        elif kind == "noticed":  # a node of the gang died `detect` ago: the run recovers
            run_id, generation, kept = payload  # type: ignore[misc]
            self.failing.discard((run_id, generation))
            self._recover(run_id, generation, at, kept)
        elif kind == "release":  # after a preemption notice: saved (or not), gives back
            run_id, generation, kept, grow = payload  # type: ignore[misc]
            if self._end(run_id, generation, at, kept=kept):
                # A shrunk gang that stopped to grow back asks as a recovery, as the run does,
                # and restarts warm on its survivors' agents.
                if grow:
                    self.growing.add(run_id)
                self._request(self.out.records[run_id], grow, at)
        elif kind == "down":
            self._down(payload, at)  # type: ignore[arg-type]
        elif kind == "up":
            node = self.nodes[payload]  # type: ignore[index]
            node.health, node.down_reason = Health.HEALTHY, None
            self.dirty = True
        elif kind == "warmed":  # a node told to fetch a hot base model holds it
            index, item = payload  # type: ignore[misc]
            assert self.caches is not None
            self.caches.warmed(self.state, index, item, self._at(self.now_s))
            self.dirty = True

    # --- the runs' side ----------------------------------------------------------------------

    def _request(self, record: JobRecord, recovery: bool, at: float) -> None:
        """As the `request_gang` signal; a requeued run keeps its first submission time."""
        job = record.job
        nodes, per_node = self._shape(job.gpus)
        attempt = self._attempt(record, at)
        requeued = record.first_grant_s is not None
        if requeued:
            record.requeued_s = at
        expected = attempt.end - attempt.granted
        elastic = self.config.recovery.min_nodes
        base = {}
        if self.caches is not None and job.base is not None:
            base = self.caches.request_fields(job.base, record.kept_s)
        request = GangRequest(
            run_id=job.run_id,
            nodes=nodes,
            gpus_per_node=per_node,
            team=job.team,
            priority=job.priority,
            max_runtime_s=expected * self.config.runtime_estimate,
            recovery=recovery,
            min_nodes=math.ceil(nodes * elastic) if nodes > 1 and elastic < 1 else None,
            submitted_at=self._at(job.submit_s),
            started_before=requeued,
            # As the Cluster workflow's enqueue sets it.
            waiting_since=self._at(at) if requeued and self.policy.requeue_deadline else None,
            **base,
        )
        self.state.queue.append(request)
        hot_pool.record_demand(self.state, request, self._at(at))  # as the Cluster's enqueue
        self.out.max_queue = max(self.out.max_queue, len(self.state.queue))
        self.dirty = True

    def _shape(self, gpus: int) -> tuple[int, int]:
        per_node = self.config.fleet.gpus_per_node
        return (1, gpus) if gpus <= per_node else (-(-gpus // per_node), per_node)

    def _attempt(
        self,
        record: JobRecord,
        granted: float,
        *,
        warm: bool = False,
        rate: float = 1.0,
        fetch_s: float = 0.0,
    ) -> Attempt:
        job = record.job
        if record.plan is None:
            nodes, _ = self._shape(job.gpus)
            mtbf_s = self.config.failures.node_mtbf_h * 3600 / nodes
            rule = self.interval or (lambda _stall, _mtbf: self.config.checkpoint_interval_s)
            record.plan = save_plan(job.save_s, mtbf_s, self.config.recovery, rule)
        # A recovering gang's agents have the run's interpreter, data and code ready.
        restart = job.restart_s * (self.config.recovery.warm_restart if warm else 1.0)
        restart += fetch_s  # the base model's copy, where a node of the gang lacked it
        return Attempt(granted, restart, record.plan, job.work_s - record.kept_s, rate)

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
        if kept > 0:
            record.failed_in_row = 0
        if finished:
            record.finished_s = at
        allocation = ops.allocation_of(self.state, run_id)
        if allocation is not None and allocation.generation == generation:
            ops.free(self.state, allocation, self._at(at))  # the `release` signal
        self.dirty = True
        return True

    def _charge(self, record: JobRecord, attempt: Attempt, at: float, kept: float) -> None:
        gpus = record.job.gpus
        held = gpus * attempt.rate * (at - attempt.granted)  # a shrunk gang holds fewer GPUs
        record.kept_s += kept
        record.allocated_gpu_s += held
        self.trace.spread(self.trace.allocated, attempt.granted, at, held)
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
            if (run_id, generation) in self.failing:
                continue  # a second node of a gang that is already failing
            self.out.records[run_id].failures += 1
            self.failing.add((run_id, generation))
            # The gang holds its nodes, stalled, until the failure is noticed.
            self._push(
                at + self._detection(), "noticed", (run_id, generation, attempt.committed(at))
            )
        self.dirty = True

    def _detection(self) -> float:
        """Mean seconds from a node's death to the run noticing: at once by its survivors,
        at the heartbeat timeout for the share of failures none of them sees."""
        recovery = self.config.recovery
        silent = recovery.silent_fraction
        return (1 - silent) * recovery.detect_s + silent * recovery.heartbeat_timeout_s

    def _recover(self, run_id: str, generation: int, at: float, kept: float) -> None:
        """Give the gang back, keeping the newest committed save, and ask again (after a
        backoff only for a failure in a row, unless the model backs off every time)."""
        record = self.out.records[run_id]
        if not self._end(run_id, generation, at, kept=kept):
            return
        record.failed_in_row += 1
        record.asked_again_s = at
        repeated = record.failed_in_row > 1 or self.config.recovery.first_backoff
        backoff = self.config.failures.recovery_backoff_s if repeated else 0.0
        self.recovering.add(run_id)
        self._push(at + backoff, "arrive", (run_id, True))

    # --- the Cluster workflow's side ---------------------------------------------------------

    def _pass(self) -> None:
        state, now = self.state, self._at(self.now_s)
        self.dirty = False
        self.out.passes += 1
        if self.switches.preemption:
            self._note_checkpoints()
        spares = {n.info.node_id for n in self.nodes if n.spare}
        for allocation in ops.prepare(state, now):  # never here: victims save within grace
            raise AssertionError(f"{allocation.run_id} revoked: a victim outlived its grace")
        decisions = schedule(state, now, self.switches)
        for run_id, signal, argument in ops.apply(state, decisions, now):
            if signal == GANG_GRANTED_SIGNAL:
                self._granted(argument, spares)  # type: ignore[arg-type]
            elif signal == PREEMPT_SIGNAL:
                self._preempted(run_id)
        self.out.idle.after_pass(state, self.now_s)
        if self.caches is not None:  # as the Cluster workflow after its pass: warming
            warmup_s = self.config.warmup_days * DAY
            for done_s, index, item in self.caches.after_pass(state, self.now_s, now, warmup_s):
                self._push(done_s, "warmed", (index, item))

    def _note_checkpoints(self) -> None:
        """The runs' `checkpoint_committed` signals: preemption prefers the freshest saves."""
        for allocation in self.state.allocations:
            attempt, _ = self.attempts[allocation.run_id]
            last = attempt.last_commit(self.now_s)
            if last is not None:
                allocation.last_checkpoint_at = self._at(last[0])

    def _granted(self, allocation: Allocation, spares: set[str]) -> None:
        record = self.out.records[allocation.run_id]
        recovery = allocation.run_id in self.recovering
        if record.asked_again_s is not None:
            record.recovery_wait_s += self.now_s - record.asked_again_s
            record.asked_again_s = None
        if record.requeued_s is not None:
            waited = self.now_s - record.requeued_s
            record.longest_requeued_wait_s = max(record.longest_requeued_wait_s, waited)
            record.requeued_s = None
        wanted = allocation.wanted.nodes if allocation.wanted is not None else None
        rate = len(allocation.nodes) / wanted if wanted else 1.0
        if rate < 1:
            record.shrunk += 1
        if recovery:
            self.recovering.discard(allocation.run_id)
            self.out.recoveries += 1
            if any(n.node_id in spares for n in allocation.nodes):
                record.spare_hits += 1
                self.out.spare_hits += 1
        record.attempts += 1
        if record.first_grant_s is None:
            record.first_grant_s = self.now_s
        warm = recovery or allocation.run_id in self.growing
        self.growing.discard(allocation.run_id)
        fetch_s = 0.0
        if self.caches is not None and record.job.base is not None and record.kept_s == 0:
            # A fine-tune without a checkpoint of its own waits for its base model.
            fetch_s = self.caches.gang_granted(
                self.state, self._at(self.now_s), record.job.base, allocation, record.attempts
            )
        attempt = self._attempt(record, self.now_s, warm=warm, rate=rate, fetch_s=fetch_s)
        if record.restart_owed_by_yielder is not None:
            restart_gpu_s = record.job.gpus * rate * attempt.restart
            self.out.preemption_cost.add(record.restart_owed_by_yielder, restart_gpu_s)
            record.restart_owed_by_yielder = None
        self.attempts[allocation.run_id] = (attempt, allocation.generation)
        self._push(attempt.end, "end", (allocation.run_id, allocation.generation))

    def _preempted(self, run_id: str) -> None:
        attempt, generation = self.attempts[run_id]
        record = self.out.records[run_id]
        release_s, kept = attempt.preempted(self.now_s, self.config.fleet.preemption_grace_s)
        if release_s >= attempt.end:
            return  # it finishes first; its normal release answers the notice
        allocation = ops.allocation_of(self.state, run_id)
        notice = allocation.preempting if allocation is not None else None
        grow = notice is not None and notice.grow_to is not None
        if grow:
            record.regrown += 1
        else:
            record.preemptions += 1
            self.out.preemptions += 1
            # A yielder told to leave for the reservation it was lent (`yields_to` is None for
            # every other gang, and a notice always names a run or "").
            yielder = notice is not None and notice.for_run == allocation.yields_to
            self.out.yielded += yielder
            thrown_away = attempt.done(self.now_s) - kept
            saving = attempt.rate * (release_s - self.now_s)
            self.out.preemption_cost.add(yielder, record.job.gpus * (thrown_away + saving))
            record.restart_owed_by_yielder = yielder
        self._push(release_s, "release", (run_id, generation, kept, grow))

    def _close(self) -> None:
        """At the horizon: running attempts are charged so far (work done counts as kept)."""
        for run_id, (attempt, _) in list(self.attempts.items()):
            record = self.out.records[run_id]
            self._charge(record, attempt, self.horizon, attempt.done(self.horizon))
        self.attempts.clear()
        self.out.idle.until(self.horizon)
        self.out.still_waiting = [r.run_id for r in self.state.queue]


def simulate(
    config: SimConfig, jobs: list[Job], outages: list[Outage], interval: IntervalRule | None
) -> Outcome:
    return Simulation(config, jobs, outages, interval).run()
