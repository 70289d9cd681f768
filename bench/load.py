"""Load: many small runs at once through one scheduler on the local stack.

    python -m bench.load [--runs 50] [--nodes 4] [--gpus-per-node 2] [--steps 20]

Starts a private stack (Temporal dev server, MLflow, control and data workers, node agents),
submits `--runs` small runs of examples/tiny.toml at once (1- and 2-node gangs, two teams, all on
one dataset, so the snapshot is prepared once and reused under contention), and watches until
every run is in a final phase. Nobody approves: each run's approval window (3.6 s) closes and it
ends EXPIRED, a final phase like any other.

While they run, the Cluster workflow's state is queried every 0.25 s and checked: no node holds
more GPUs than it has, no node is held by a gang it does not list, no run holds two gangs. Each
queried state is also scheduled again by the same policy function (`workflows.scheduler.schedule`)
to time one decision at the queue depth the stack really had, beside the trivial pass of an empty
queue on the same nodes (the baseline). From the runs' own records: request-to-grant waits, and
the wall time from the first submission to the last final phase.

Exits non-zero if a run is lost (no final phase, or no workflow), or an invariant breaks.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from infra.settings import load_settings
from worker.runs import submit
from worker.specfile import load_spec, spec_sha256
from worker.stack import free_port_flags
from worker.temporal_client import connect
from workflows.cluster_models import ClusterState
from workflows.fleet.report import percentile
from workflows.models import Phase, RunStatus
from workflows.names import CLUSTER_WORKFLOW_ID
from workflows.scheduler import schedule

REPO = Path(__file__).resolve().parent.parent
FORGELINE = str(Path(sys.executable).parent / "forgeline")
FINAL = {Phase.APPROVED, Phase.REJECTED, Phase.EXPIRED, Phase.FAILED, Phase.CANCELLED}


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


def check(state: ClusterState, watch: Watch) -> None:
    """The invariants of one observed state; then one decision on it, timed, and the baseline."""
    watch.samples += 1
    watch.max_queue = max(watch.max_queue, len(state.queue))
    watch.max_running = max(watch.max_running, len(state.allocations))
    listed: dict[str, set[str]] = {}
    for allocation in state.allocations:
        listed.setdefault(allocation.run_id, set())
        if listed[allocation.run_id] & {n.node_id for n in allocation.nodes}:
            watch.violations.append(f"{allocation.run_id} lists a node twice")
        listed[allocation.run_id] |= {n.node_id for n in allocation.nodes}
    runs = Counter(a.run_id for a in state.allocations)
    watch.violations += [f"{run} holds {n} gangs" for run, n in runs.items() if n > 1]
    for node in state.nodes:
        if sum(node.jobs.values()) > node.info.gpus:
            watch.violations.append(f"{node.info.node_id} double-booked: {node.jobs}")
        for run in node.jobs:
            if node.info.node_id not in listed.get(run, set()):
                watch.violations.append(f"{node.info.node_id} held by {run}, not in its gang")
    now = datetime.now(UTC)
    started = time.perf_counter()
    schedule(state, now)
    watch.decision_ms.append((time.perf_counter() - started) * 1000)
    empty = state.model_copy(update={"queue": []})
    started = time.perf_counter()
    schedule(empty, now)
    watch.empty_ms.append((time.perf_counter() - started) * 1000)


async def drive(home: Path, specs: list[Path]) -> tuple[dict[str, RunStatus], Watch, float]:
    client = await connect(load_settings(home))
    cluster = client.get_workflow_handle(CLUSTER_WORKFLOW_ID)
    loaded = [(spec, spec_sha256(spec)) for spec in map(load_spec, specs)]
    started = time.monotonic()
    handles = await asyncio.gather(*(submit(client, spec, sha) for spec, sha in loaded))
    names = [handle.id for handle, _ in handles]
    watch = Watch()
    final: dict[str, RunStatus] = {}
    while len(final) < len(names):
        state = await cluster.query("state", result_type=ClusterState)
        check(state, watch)
        for name in names:
            if name in final:
                continue
            status = await client.get_workflow_handle(name).query("status", result_type=RunStatus)
            if status.phase in FINAL:
                final[name] = status
        if time.monotonic() - started > 3600:
            break
        await asyncio.sleep(0.25)
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
            os.environ["FORGELINE_HOME"] = str(home)
            final, watch, wall_s = asyncio.run(drive(home, specs))
            return report(args.runs, final, watch, wall_s)
        finally:
            subprocess.run([FORGELINE, "down"], env=env, capture_output=True, timeout=300)


if __name__ == "__main__":
    sys.exit(main())
