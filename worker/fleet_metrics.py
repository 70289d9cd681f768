"""The fleet and its runs as Prometheus metrics: what the API's `/metrics` serves.

Built at scrape time from the two views everything else reads (the Cluster workflow's state and
each run's status and newest heartbeat), so a scrape shows exactly what `forgeline nodes`,
`queues` and `status` would, and nothing is kept between scrapes that could drift from them.

Labels stay bounded: a node, its pod and a state word; a team; a run (only runs whose workflow
is still open: a run that ended drops out of the scrape, as a finished pod does from
kube-state-metrics) and a goodput cause from a fixed list. No step, generation or checkpoint
is ever a label; those are values. With a twin site, the replicator's last status (which it
writes to the twin after every pass) adds the replication metrics.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from infra.errors import StoreError
from infra.replication import ReplicationStatus
from infra.settings import Settings
from infra.store.factory import open_store
from worker.fleet_view import waited_s
from workflows.contracts.api_models import RunView
from workflows.contracts.cluster_models import ClusterState, GangRequest
from workflows.contracts.models import Phase
from workflows.goodput import CAUSES
from workflows.scheduling.quotas import in_use

# Node.state's words: every node reports each of them, 1 for the one it is in, so an alert can
# say `forgeline_node_state{state="down"} == 1` and a node that recovers reads 0, not absent.
NODE_STATES = ("idle", "partial", "allocated", "spare", "cordoned", "draining", "down")


class FleetCollector(Collector):
    """One scrape's metrics from one cluster state and the open runs' views."""

    def __init__(
        self,
        state: ClusterState,
        runs: Iterable[RunView],
        now: datetime,
        twin: TwinReading | None = None,
    ) -> None:
        self.state, self.runs, self.now = state, list(runs), now
        self.twin = twin

    def collect(self) -> Iterator[Metric]:
        yield from self._nodes()
        yield from self._teams()
        yield from self._runs()
        if self.twin is not None:
            yield GaugeMetricFamily(
                "forgeline_replication_status_readable",
                "1 when the twin site answered with the replicator's status",
                value=float(self.twin.status is not None),
            )
        if self.twin is not None and self.twin.status is not None:
            yield from self._replication(self.twin.status)

    def _replication(self, status: ReplicationStatus) -> Iterator[Metric]:
        """The twin site, from the status the replicator writes there after every pass."""
        passed = datetime.fromisoformat(status.updated_at)
        yield GaugeMetricFamily(
            "forgeline_replication_status_age_seconds",
            "since the replicator's last pass (it passes every few seconds while it runs)",
            value=max(0.0, (self.now - passed).total_seconds()),
        )
        yield GaugeMetricFamily(
            "forgeline_replication_pending",
            "committed checkpoints and snapshots not yet complete on the twin site",
            value=len(status.pending),
        )
        newest = status.recent[0].lag_s if status.recent else 0.0
        yield GaugeMetricFamily(
            "forgeline_replication_lag_seconds",
            "from the newest replicated unit's commit on the primary to its copy on the twin",
            value=newest,
        )
        yield GaugeMetricFamily(
            "forgeline_replication_primary_reachable",
            "1 when the replicator's last pass reached the primary site",
            value=float(status.primary_reachable),
        )

    def _nodes(self) -> Iterator[Metric]:
        state = GaugeMetricFamily(
            "forgeline_node_state",
            "1 for the state the node is in",
            labels=["node", "pod", "state"],
        )
        gpus = GaugeMetricFamily("forgeline_node_gpus", "GPUs (rank slots)", labels=["node", "pod"])
        used = GaugeMetricFamily(
            "forgeline_node_gpus_used", "GPUs held by gangs", labels=["node", "pod"]
        )
        failing = GaugeMetricFamily(
            "forgeline_node_health_check_failing",
            "1 while the node's own health check fails (it takes no new work)",
            labels=["node", "pod"],
        )
        for node in self.state.nodes:
            where = [node.info.node_id, node.info.pod]
            for word in NODE_STATES:
                state.add_metric([*where, word], float(node.state == word))
            gpus.add_metric(where, node.info.gpus)
            used.add_metric(where, node.used)
            failing.add_metric(where, float(node.health_reason is not None))
        yield from (state, gpus, used, failing)

    def _teams(self) -> Iterator[Metric]:
        config = self.state.config
        waiting: dict[str, list[GangRequest]] = {}
        for request in self.state.queue:
            waiting.setdefault(request.team, []).append(request)
        used = in_use(config, self.state.allocations)
        teams = sorted({q.name for q in config.queues} | set(waiting) | set(used))
        depth = GaugeMetricFamily(
            "forgeline_queue_requests", "gang requests waiting", labels=["team"]
        )
        oldest = GaugeMetricFamily(
            "forgeline_queue_oldest_wait_seconds",
            "how long the team's longest-waiting request has waited (0: none waits)",
            labels=["team"],
        )
        in_use_now = GaugeMetricFamily(
            "forgeline_team_gpus_in_use", "GPUs its gangs hold (a parent counts its teams')",
            labels=["team"],
        )  # fmt: skip
        guaranteed = GaugeMetricFamily(
            "forgeline_team_gpus_guaranteed", "GPUs it can always reclaim", labels=["team"]
        )
        ceiling = GaugeMetricFamily(
            "forgeline_team_gpus_max", "the most it may hold (only where one is set)",
            labels=["team"],
        )  # fmt: skip
        for team in teams:
            queue = config.queue(team)
            requests = waiting.get(team, [])
            depth.add_metric([team], len(requests))
            oldest.add_metric([team], max((waited_s(r, self.now) for r in requests), default=0.0))
            in_use_now.add_metric([team], used.get(team, 0))
            guaranteed.add_metric([team], queue.guaranteed_gpus)
            if queue.max_gpus is not None:
                ceiling.add_metric([team], queue.max_gpus)
        yield from (depth, oldest, in_use_now, guaranteed, ceiling)

    def _runs(self) -> Iterator[Metric]:
        def gauge(name: str, text: str, *extra: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, text, labels=["run", *extra])

        def counter(name: str, text: str) -> CounterMetricFamily:
            return CounterMetricFamily(name, text, labels=["run"])

        phase = gauge("forgeline_run_phase", "1 for the phase the run is in", "phase")
        info = gauge("forgeline_run_info", "the run's owner and team", "owner", "team")
        step = gauge("forgeline_run_step", "the newest step the gang reported")
        total = gauge("forgeline_run_total_steps", "the steps the run trains")
        rate = gauge("forgeline_run_tokens_per_second", "throughput of the newest heartbeat")
        mfu = gauge("forgeline_run_mfu_ratio", "model FLOPs utilisation of the newest heartbeat")
        goodput = gauge(
            "forgeline_run_goodput_ratio", "GPU-time that ended in a kept checkpoint, of all"
        )
        lost = gauge("forgeline_run_lost_gpu_seconds", "GPU-time lost, by cause", "cause")
        checkpoint = gauge("forgeline_run_checkpoint_step", "the newest committed checkpoint")
        age = gauge(
            "forgeline_run_checkpoint_age_seconds",
            "since the gang's newest checkpoint committed (only while it holds a gang)",
        )
        restarts = counter("forgeline_run_restarts", "gang attempts after the first")
        failures = counter("forgeline_run_failures", "attempts that failed")
        preemptions = counter("forgeline_run_preemptions", "attempts that were preempted")
        committed_at = {
            a.run_id: a.last_checkpoint_at
            for a in self.state.allocations
            if a.last_checkpoint_at is not None
        }
        for view in self.runs:
            status, run = view.status, [view.status.name]
            for word in Phase:
                phase.add_metric([*run, word.value], float(status.phase == word))
            info.add_metric([*run, status.owner, status.team], 1.0)
            total.add_metric(run, status.total_steps)
            restarts.add_metric(run, max(0, status.attempts - 1))
            failures.add_metric(run, status.failures_total)
            preemptions.add_metric(run, status.preemptions_total)
            if view.newest_step is not None:
                step.add_metric(run, view.newest_step)
            beat = view.progress
            if beat is not None and beat.tokens_per_s is not None:
                rate.add_metric(run, beat.tokens_per_s)
            if beat is not None and beat.mfu is not None:
                mfu.add_metric(run, beat.mfu)
            if status.last_checkpoint is not None:
                checkpoint.add_metric(run, status.last_checkpoint.step)
            if status.name in committed_at:
                since = self.now - committed_at[status.name]
                age.add_metric(run, max(0.0, since.total_seconds()))
            if status.goodput is not None:
                goodput.add_metric(run, status.goodput.goodput)
                for cause in CAUSES:
                    lost.add_metric([*run, cause], status.goodput.lost_gpu_s.get(cause, 0.0))
        yield from (phase, info, step, total, rate, mfu, goodput, lost, checkpoint, age)
        yield from (restarts, failures, preemptions)


def exposition(
    state: ClusterState,
    runs: Iterable[RunView],
    now: datetime,
    twin: TwinReading | None = None,
) -> bytes:
    """The Prometheus text format of one scrape."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(FleetCollector(state, runs, now, twin))
    return generate_latest(registry)


@dataclass(frozen=True)
class TwinReading:
    """The replicator's last status as the twin site held it; None when the twin did not
    answer or holds none yet (a scrape never fails for it: the metric says so)."""

    status: ReplicationStatus | None


def twin_status(settings: Settings) -> TwinReading | None:
    """None: this stack has no twin site."""
    if not settings.twin_store_url:
        return None
    try:
        return TwinReading(ReplicationStatus.read(open_store(settings.twin_store_url)))
    except StoreError:
        return TwinReading(None)
