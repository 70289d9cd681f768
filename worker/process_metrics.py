"""A process's own /metrics for Prometheus: the control worker's, a data worker's, a node
agent's. Each serves what it knows (an agent: its cache and its health check) beside the
Temporal SDK's own metrics (workflow and activity task latencies, polls, slots), on one port.

The SDK's metrics reach Python through a `MetricBuffer` (its Rust core records them; a thread
here drains the buffer every second, as the SDK asks, and keeps the running values): counters
add their deltas, gauges keep their last value, histograms become a summary (count and sum,
in seconds). One port per process: Temporal's own Prometheus exporter would need a second.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.registry import Collector
from temporalio.runtime import (
    BUFFERED_METRIC_KIND_COUNTER,
    BUFFERED_METRIC_KIND_GAUGE,
    MetricBuffer,
    MetricBufferDurationFormat,
    Runtime,
    TelemetryConfig,
)

from infra import node_health
from infra.cache_budget import CacheBudget
from infra.processes import ManagedProcess

log = logging.getLogger(__name__)
METRICS_ADDRESS_ENV = "FORGELINE_METRICS_ADDRESS"
BUFFER_SIZE = 20_000  # updates between drains (one a second): far more than a worker makes
_NOT_A_NAME = re.compile(r"[^a-zA-Z0-9_]")


def _prometheus_name(name: str) -> str:
    return "temporal_" + _NOT_A_NAME.sub("_", name.removeprefix("temporal_"))


@dataclass
class _Series:
    kind: int
    description: str
    # Per label set: the running total (counter), last value (gauge) or (count, sum).
    values: dict[tuple[tuple[str, str], ...], float | tuple[int, float]] = field(
        default_factory=dict
    )


class TemporalMetrics(Collector):
    """The Temporal SDK's metrics of this process, as Prometheus families."""

    def __init__(self, drain_every_s: float = 1.0) -> None:
        self.buffer = MetricBuffer(BUFFER_SIZE, MetricBufferDurationFormat.SECONDS)
        self.runtime = Runtime(telemetry=TelemetryConfig(metrics=self.buffer))
        self._series: dict[str, _Series] = {}
        self._lock = threading.Lock()
        self._every_s = drain_every_s
        threading.Thread(target=self._drain_forever, name="temporal-metrics", daemon=True).start()

    def _drain_forever(self) -> None:
        while True:
            try:
                self.drain()
            except Exception:  # metrics must never take a worker down
                log.warning("could not read the Temporal SDK's metrics", exc_info=True)
            time.sleep(self._every_s)

    def drain(self) -> None:
        updates = self.buffer.retrieve_updates()
        with self._lock:
            for update in updates:
                metric = update.metric
                series = self._series.setdefault(
                    metric.name, _Series(metric.kind, metric.description or metric.name)
                )
                labels = tuple(sorted((k, str(v)) for k, v in update.attributes.items()))
                if metric.kind == BUFFERED_METRIC_KIND_COUNTER:
                    series.values[labels] = float(series.values.get(labels, 0.0)) + update.value
                elif metric.kind == BUFFERED_METRIC_KIND_GAUGE:
                    series.values[labels] = float(update.value)
                else:  # a histogram's single observation
                    count, total = series.values.get(labels, (0, 0.0))  # type: ignore[misc]
                    series.values[labels] = (count + 1, total + update.value)

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            snapshot = {
                name: (s.kind, s.description, dict(s.values)) for name, s in self._series.items()
            }
        for name, (kind, text, values) in sorted(snapshot.items()):
            yield from _family(_prometheus_name(name), kind, text, values)


def _family(name: str, kind: int, text: str, values: dict) -> Iterable[Metric]:
    keys = sorted({k for labels in values for k, _ in labels})
    if kind == BUFFERED_METRIC_KIND_COUNTER:
        family: Metric = CounterMetricFamily(name, text, labels=keys)
    elif kind == BUFFERED_METRIC_KIND_GAUGE:
        family = GaugeMetricFamily(name, text, labels=keys)
    else:
        family = SummaryMetricFamily(name, text, labels=keys)
    for labels, value in values.items():
        given = dict(labels)
        label_values = [given.get(k, "") for k in keys]
        if isinstance(family, SummaryMetricFamily):
            count, total = value
            family.add_metric(label_values, count_value=count, sum_value=total)
        else:
            family.add_metric(label_values, value)  # type: ignore[union-attr]
    return [family]


class NodeAgentMetrics(Collector):
    """What a node agent knows that the cluster's view does not: its cache's use against its
    budget, the snapshots it holds whole, its own health check's verdict, a warm standby."""

    def __init__(
        self, node_id: str, node_dir: Path, cache: CacheBudget, standby: Callable[[], bool]
    ):
        self.node_id, self.node_dir, self.cache, self.standby = node_id, node_dir, cache, standby

    def collect(self) -> Iterator[Metric]:
        node = [self.node_id]

        def gauge(name: str, text: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, text, labels=["node"])
            family.add_metric(node, value)
            return family

        yield gauge(
            "forgeline_agent_cache_bytes", "held in the node's cache", self.cache.used_bytes()
        )
        yield gauge(
            "forgeline_agent_cache_budget_bytes", "what the cache may hold", self.cache.budget_bytes
        )
        yield gauge(
            "forgeline_agent_cached_snapshots",
            "dataset snapshots held whole",
            len(self.cache.held_snapshots()),
        )
        failing = node_health.failing(self.node_dir) is not None
        yield gauge(
            "forgeline_agent_health_check_failing", "1 while its own check fails", float(failing)
        )
        yield gauge(
            "forgeline_agent_warm_standby_ready",
            "1 while a torchrun waits, torch imported",
            float(self.standby()),
        )


class ProcessMetrics:
    """A process's endpoint, when FORGELINE_METRICS_ADDRESS (HOST:PORT, port 0 for any) asks
    for one: first the Temporal runtime to connect with, then `serve` with what else the
    process knows. The URL it serves at goes to run/NAME.metrics in the state folder, where
    `forgeline up`'s caller (and the tests) find it."""

    def __init__(self, home: Path, name: str) -> None:
        self.home, self.name = home, name
        self.address = os.environ.get(METRICS_ADDRESS_ENV, "")
        self.temporal = TemporalMetrics() if self.address else None

    @property
    def runtime(self) -> Runtime | None:
        return self.temporal.runtime if self.temporal is not None else None

    def serve(self, *collectors: Collector) -> str | None:
        if self.temporal is None:
            return None
        url = serve(self.address, [self.temporal, *collectors])
        where = endpoint_file(self.home, self.name)
        where.parent.mkdir(parents=True, exist_ok=True)
        where.write_text(url + "\n")
        log.info("metrics at %s", url)
        return url


def endpoint_file(home: Path, name: str) -> Path:
    return home / "run" / f"{name}.metrics"


def endpoints(home: Path) -> dict[str, str]:
    """Each running process's metrics URL, by its name (run/NAME.metrics; a file left by a
    process that has stopped names nothing)."""
    return {
        p.stem: p.read_text().strip()
        for p in sorted((home / "run").glob("*.metrics"))
        if ManagedProcess(home, p.stem).running()
    }


def serve(address: str, collectors: Iterable[Collector]) -> str:
    """Serve `collectors` at http://ADDRESS/metrics (port 0: any free one); the URL it serves."""
    host, _, port = address.rpartition(":")
    registry = CollectorRegistry(auto_describe=False)
    for collector in collectors:
        registry.register(collector)
    server, _ = start_http_server(int(port or 0), addr=host or "127.0.0.1", registry=registry)
    bound_host, bound_port = server.server_address[:2]
    return f"http://{bound_host}:{bound_port}/metrics"
