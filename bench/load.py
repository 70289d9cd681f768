"""Load: many small runs at once through one scheduler on the local stack.

    python -m bench.load [--runs 50] [--nodes 4] [--gpus-per-node 2] [--steps 20]

Starts a private stack (Temporal dev server, MLflow, control and data workers, node agents),
submits `--runs` small runs of examples/tiny.toml at once through the HTTP API (one
`forgeline.Client` request per run, all in flight together; 1- and 2-node gangs, two teams, all
on one dataset, so the snapshot is prepared once and reused under contention), and watches
through the API until every run is in a final phase. Nobody approves: each run's approval
window (3.6 s) closes and it ends EXPIRED, a final phase like any other.

While they run, the cluster's state (GET /v1/cluster) is read every 0.25 s and checked: no node
holds more GPUs than it has, no node is held by a gang it does not list, no run holds two gangs.
Each state read is also scheduled again by the same policy function
(`workflows.scheduling.scheduler.schedule`) to time one
decision at the queue depth the stack really had,
beside the trivial pass of an empty queue on the same nodes (the baseline). From the runs' own
records: request-to-grant waits, and the wall time from the first submission to the last final
phase. Every API request is timed:
latency p50 / p99 per kind of request (submit, list runs, cluster state), beside the scheduler's
figures.

Exits non-zero if a run is lost (no final phase, or no workflow), or an invariant breaks.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import TypeVar

from bench.cluster_invariants import booking_violations
from forgeline.client import Client
from infra.settings import load_settings
from infra.tokens import caller_token
from worker.stack import free_port_flags
from workflows.contracts.cluster_models import ClusterState
from workflows.contracts.models import Phase, RunStatus
from workflows.scheduling.fleet.report import percentile
from workflows.scheduling.scheduler import schedule

REPO = Path(__file__).resolve().parent.parent
FORGELINE = str(Path(sys.executable).parent / "forgeline")
FINAL = {Phase.APPROVED, Phase.REJECTED, Phase.EXPIRED, Phase.FAILED, Phase.CANCELLED}
SUBMIT, LIST, CLUSTER = "POST /v1/runs", "GET /v1/runs", "GET /v1/cluster"
T = TypeVar("T")


def spec_files(folder: Path, runs: int, steps: int) -> list[Path]:
    template = (
        (REPO / "examples" / "tiny.toml")
        .read_text()
        .replace('"data/tinyshakespeare.txt"', f'"{REPO}/examples/data/tinyshakespeare.txt"')
    )
    paths = []
    for i in range(runs):
        text = template.replace('name = "tiny"', f'name = "load-{i:02d}"')
        text = re.sub(r"^steps = .*$", f"steps = {steps}", text, flags=re.M)
        text = re.sub(r"^checkpoint_every = .*$", f"checkpoint_every = {steps}", text, flags=re.M)
        text = re.sub(r"^nodes = .*$", f"nodes = {1 + i % 2}", text, flags=re.M)
        text = text.replace("[registry]\n", "[registry]\napproval_window_hours = 0.001\n")
        text = text.replace("[resources]\n", f'[resources]\nteam = "{("a", "b")[i % 2]}"\n')
        path = folder / f"load-{i:02d}.toml"
        path.write_text(text)
        paths.append(path)
    return paths


@dataclass
class Watch:
    samples: int = 0
    violations: list[str] = field(default_factory=list)
    decision_ms: list[float] = field(default_factory=list)
    empty_ms: list[float] = field(default_factory=list)
    max_queue: int = 0
    max_running: int = 0
    latency: dict[str, list[float]] = field(default_factory=dict)  # ms, by kind of request


def check(state: ClusterState, watch: Watch) -> None:
    """The invariants of one observed state; then one decision on it, timed, and the baseline."""
    watch.samples += 1
    watch.max_queue = max(watch.max_queue, len(state.queue))
    watch.max_running = max(watch.max_running, len(state.allocations))
    watch.violations += booking_violations(state)
    now = datetime.now(UTC)
    started = time.perf_counter()
    schedule(state, now)
    watch.decision_ms.append((time.perf_counter() - started) * 1000)
    empty = state.model_copy(update={"queue": []})
    started = time.perf_counter()
    schedule(empty, now)
    watch.empty_ms.append((time.perf_counter() - started) * 1000)


def timed(latency: dict[str, list[float]], kind: str, request: Callable[[], T]) -> T:
    started = time.perf_counter()
    try:
        return request()
    finally:
        latency.setdefault(kind, []).append((time.perf_counter() - started) * 1000)


def drive(api: Client, specs: list[Path]) -> tuple[dict[str, RunStatus], Watch, float]:
    watch = Watch()
    started = time.monotonic()
    # Every submit in flight at once, as many programs submitting together would be.
    with ThreadPoolExecutor(max_workers=len(specs)) as pool:
        submits = [pool.submit(timed, watch.latency, SUBMIT, partial(api.submit, path))
                   for path in specs]  # fmt: skip
        names = [future.result().status.name for future in submits]
    final: dict[str, RunStatus] = {}
    while len(final) < len(names):
        check(timed(watch.latency, CLUSTER, api.cluster), watch)
        for run in timed(watch.latency, LIST, api.runs):
            if run.status.name in names and run.status.phase in FINAL:
                final[run.status.name] = run.status
        if time.monotonic() - started > 3600:
            break
        time.sleep(0.25)
    return final, watch, time.monotonic() - started


def _ratio(measured: list[float], baseline: list[float]) -> float:
    if not measured or not baseline:
        return 0.0
    return statistics.median(measured) / max(1e-9, statistics.median(baseline))


def report(runs: int, final: dict[str, RunStatus], watch: Watch, wall_s: float) -> int:
    waits = [
        (a.granted_at - a.requested_at).total_seconds()
        for status in final.values()
        for a in status.gang_attempts
    ]
    phases = Counter(status.phase.value for status in final.values())
    lost = runs - len(final)
    rows = [
        ("runs submitted / in a final phase", f"{runs} / {len(final)}  {dict(phases)}"),
        ("lost", str(lost)),
        ("invariant violations", str(len(watch.violations))),
        ("wall time, first submit to last final phase", f"{wall_s:.1f} s"),
        ("cluster states checked", f"{watch.samples} (queue ≤ {watch.max_queue}, "
                                   f"gangs ≤ {watch.max_running})"),
        ("schedule() on the observed states, p50 / p99", f"{percentile(watch.decision_ms, 50):.2f}"
         f" / {percentile(watch.decision_ms, 99):.2f} ms"),
        ("baseline: same nodes, empty queue, p50 / p99", f"{percentile(watch.empty_ms, 50):.2f}"
         f" / {percentile(watch.empty_ms, 99):.2f} ms"),
        ("ratio of the p50s", f"{_ratio(watch.decision_ms, watch.empty_ms):.1f}×"),
        ("request → grant wait, p50 / p99 / max", f"{percentile(waits, 50):.1f} / "
         f"{percentile(waits, 99):.1f} / {max(waits, default=0):.1f} s"),
    ]  # fmt: skip
    rows += [
        (f"API {kind}, p50 / p99 (n)", f"{percentile(ms, 50):.0f} / {percentile(ms, 99):.0f} ms"
                                       f" ({len(ms)})")
        for kind, ms in watch.latency.items()
    ]  # fmt: skip
    width = max(len(name) for name, _ in rows)
    print(f"\n{'figure':<{width}}  value")
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    for violation in watch.violations[:20]:
        print("VIOLATION", violation)
    failed = [n for n, s in final.items() if s.phase == Phase.FAILED]
    for name in failed[:5]:
        print("FAILED", name, final[name].error)
    return 1 if lost or watch.violations else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--gpus-per-node", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="forgeline-load-") as tmp:
        home = Path(tmp) / "home"
        env = {**os.environ, "FORGELINE_HOME": str(home)}
        up = [FORGELINE, "up", "--nodes", str(args.nodes), "--gpus-per-node",
              str(args.gpus_per_node), *free_port_flags()]  # fmt: skip
        subprocess.run(up, env=env, check=True, capture_output=True, timeout=300)
        try:
            (Path(tmp) / "specs").mkdir()
            cluster = Path(tmp) / "cluster.toml"
            cluster.write_text(
                'pods = ["local"]\n[[queues]]\nname = "a"\nguaranteed_gpus = 4\n'
                '[[queues]]\nname = "b"\nguaranteed_gpus = 4\n'
            )
            subprocess.run([FORGELINE, "cluster", "apply", str(cluster)], env=env, check=True,
                           capture_output=True, timeout=120)  # fmt: skip
            specs = spec_files(Path(tmp) / "specs", args.runs, args.steps)
            settings = load_settings(home)
            api = Client(settings.api_url, caller_token(home))  # the stack's admin, `up` made
            final, watch, wall_s = drive(api, specs)
            return report(args.runs, final, watch, wall_s)
        finally:
            subprocess.run([FORGELINE, "down"], env=env, capture_output=True, timeout=300)


if __name__ == "__main__":
    sys.exit(main())
