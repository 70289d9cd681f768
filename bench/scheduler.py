"""Scheduling-decision latency at production size: the pure policy, no Temporal.

    python -m bench.scheduler [--passes 60] [--seed 0] [--no-profile]

Builds 2,500 nodes x 8 GPUs in pods of 32 (most H100, a few pods of A100), about 70 % of the
GPUs held by running allocations of a realistic mix, and 1,000 pending requests (most single
node; about 60 % of the GPU-hours in 64-1,024-GPU gangs; a few 4,096-GPU gangs), several teams
with guarantees and ceilings. Then, pass after pass as the `Cluster` workflow would: the world
moves (the earliest runs finish until ~70 % is busy again, a request like each one granted
arrives so 1,000 of the same mix wait, 30 s pass), usage decays, `schedule(state, now)` runs
(timed) and its decisions are applied.

Prints one table: the full pass, the pass per request considered, and `place()` alone per size
class, each beside a naive baseline on the same input (a linear first-fit scan of every node
for every request; the naive pass only orders and places: no quotas, preemption or backfill),
and whether the issue's target (<= 10 ms median per decision) is met. Then a cProfile of one
pass: where the time goes.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import random
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TypeVar

from workflows.contracts.cluster_models import (
    ClusterConfig,
    ClusterState,
    GangRequest,
    Node,
    NodeInfo,
    QueueConfig,
)
from workflows.scheduling import cluster_ops as ops
from workflows.scheduling.placement import Capacity, place
from workflows.scheduling.scheduler import Decisions, schedule

NODES, GPUS_PER_NODE, POD_SIZE = 2_500, 8, 32
A100_PODS = 9  # the last pods: ~11 % of the nodes, so a few requests ask for a type
BUSY = 0.70
PENDING = 1_000
GANG_SHARE = 0.60  # of pending GPU-hours, in 64-1,024-GPU gangs
HUGE = 3  # 4,096-GPU (512-node) requests
TARGET_MS = 10.0
REPO = Path(__file__).resolve().parent.parent
T = TypeVar("T")
START = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
SNAPSHOTS = [f"snap-{i:02d}" for i in range(20)]
TEAMS = {  # team -> weight of its share of requests
    "llm": 5,
    "vision": 2,
    "speech": 1,
    "ranking": 3,
    "search": 2,
    "ads": 1,
    "adhoc": 1,
}


def config() -> ClusterConfig:
    q = QueueConfig
    return ClusterConfig(
        queues=[
            q(name="research", guaranteed_gpus=9_000),
            q(name="llm", parent="research", guaranteed_gpus=6_000, max_gpus=14_000),
            q(name="vision", parent="research", guaranteed_gpus=2_000, max_gpus=6_000),
            q(name="speech", parent="research", guaranteed_gpus=1_000, max_gpus=3_000),
            q(name="product", guaranteed_gpus=6_000, max_gpus=12_000),
            q(name="ranking", parent="product", guaranteed_gpus=3_000, max_gpus=8_000),
            q(name="search", parent="product", guaranteed_gpus=2_000),
            q(name="ads", parent="product", guaranteed_gpus=1_000, max_gpus=4_000),
        ],  # adhoc: undeclared, so no guarantee and no ceiling (it only borrows)
        spare_nodes=8,
        preemption_grace_s=300,
        aging_s=3_600,
    )


def cluster(rng: random.Random) -> list[Node]:
    pods = (NODES + POD_SIZE - 1) // POD_SIZE
    nodes = []
    for i in range(NODES):
        pod = i // POD_SIZE
        info = NodeInfo(
            node_id=f"node{i:04d}",
            host=f"10.{pod}.{i % POD_SIZE}.1",
            gpus=GPUS_PER_NODE,
            gpu_type="a100" if pod >= pods - A100_PODS else "h100",
            pod=f"pod{pod:02d}",
            rdzv_port=29_500,
            incarnation="bench",
            cached=rng.sample(SNAPSHOTS, rng.randint(0, 2)),
        )
        nodes.append(Node(info=info))
    return nodes


# --- the request mix ---------------------------------------------------------------------------


class Mix:
    """Requests of three kinds: single node (1-8 GPUs), gangs of 8-128 nodes, 512-node gangs."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.count = 0

    def _request(self, nodes: int, gpus_per_node: int, runtime_h: float) -> GangRequest:
        rng = self.rng
        self.count += 1
        kind = rng.random()
        return GangRequest(
            run_id=f"run-{self.count:06d}",
            nodes=nodes,
            gpus_per_node=gpus_per_node,
            team=rng.choices(list(TEAMS), weights=list(TEAMS.values()))[0],
            gpu_type="a100" if kind < 0.08 else "h100" if kind < 0.25 else None,
            priority=rng.choices([0, 1, 2, 3], weights=[70, 20, 8, 2])[0],
            preemptible=rng.random() < 0.7,
            max_runtime_s=runtime_h * 3600,
            cache_items=[rng.choice(SNAPSHOTS)] if rng.random() < 0.3 else [],
            allow_multi_pod=nodes > POD_SIZE or rng.random() < 0.8,
        )

    def single(self) -> GangRequest:
        gpus = self.rng.choices([1, 2, 4, 8], weights=[35, 20, 20, 25])[0]
        return self._request(1, gpus, self.rng.uniform(0.5, 24))

    def gang(self) -> GangRequest:
        nodes = round(2 ** self.rng.uniform(3, 7))  # 8-128 nodes, log-uniform
        return self._request(nodes, GPUS_PER_NODE, self.rng.uniform(2, 24))

    def huge(self) -> GangRequest:
        return self._request(512, GPUS_PER_NODE, self.rng.uniform(12, 48))

    def pending(self, now: datetime) -> list[GangRequest]:
        """PENDING requests: HUGE huge ones, gangs until they hold GANG_SHARE of the GPU-hours."""
        huge = [self.huge() for _ in range(HUGE)]
        singles = [self.single() for _ in range(PENDING)]
        gangs: list[GangRequest] = []

        def hours(requests: list[GangRequest]) -> float:
            return sum(r.gpus * (r.max_runtime_s or 0) / 3600 for r in requests)

        while True:
            kept = singles[: PENDING - HUGE - len(gangs)]
            gang_h = hours(gangs)
            if gang_h >= GANG_SHARE * (gang_h + hours(kept) + hours(huge)):
                break
            gangs.append(self.gang())
        requests = huge + gangs + kept
        return [self.submitted(r, now) for r in requests]

    def like(self, request: GangRequest, now: datetime) -> GangRequest:
        """A new request of the same kind (single node, gang, or 512 nodes), submitted now."""
        fresh = (
            self.single() if request.nodes == 1 else self.huge() if request.nodes >= 512
            else self.gang()
        )  # fmt: skip
        return fresh.model_copy(update={"submitted_at": now})

    def submitted(self, request: GangRequest, now: datetime) -> GangRequest:
        waited = timedelta(hours=self.rng.uniform(0, 8))
        return request.model_copy(update={"submitted_at": now - waited})


# --- the workflow's side: apply decisions, release ----------------------------------------------


def book(state: ClusterState, request: GangRequest, node_ids: list[str], now: datetime) -> None:
    """One grant, applied as the `Cluster` workflow applies every grant."""
    state.queue.append(request)
    ops.apply(state, Decisions(grants=[(request, node_ids)]), now)


def busy(state: ClusterState) -> float:
    return sum(n.used for n in state.nodes) / (NODES * GPUS_PER_NODE)


def initial_state(rng: random.Random, mix: Mix) -> ClusterState:
    """Running allocations placed by the real `place()` until BUSY, then the pending queue."""
    state = ClusterState(config=config(), nodes=cluster(rng))
    capacity = Capacity((n.info, n.free) for n in state.nodes)
    while busy(state) < BUSY:
        roll = rng.random()
        request = mix.gang() if roll < 0.04 else mix.single()
        node_ids = place(request, capacity)
        if node_ids is None:
            continue
        runtime_s = request.max_runtime_s or 3600
        granted = START - timedelta(seconds=rng.uniform(0, 0.9 * runtime_s))
        book(state, request, node_ids, granted)
        for node_id in node_ids:
            capacity.take(node_id, capacity.free[node_id] if request.nodes > 1 else request.gpus)
        state.allocations[-1].last_checkpoint_at = START - timedelta(minutes=rng.uniform(0, 30))
    state.queue = mix.pending(START)
    return state


def perturb(
    state: ClusterState, rng: random.Random, mix: Mix, now: datetime, granted: list[GangRequest]
) -> None:
    """The world between two passes, keeping the load steady: runs finish (the earliest started
    first, and victims past their deadline) down to BUSY, and a request like each one granted
    arrives, so the queue keeps its size and mix. At least one release and one arrival."""
    for allocation in list(state.allocations):
        if allocation.preempting and now > allocation.preempting.deadline:
            ops.free(state, allocation, now)  # the victim checkpointed and gave its gang back
    oldest = sorted(state.allocations, key=lambda a: a.granted_at or START)
    ops.free(state, oldest.pop(0), now)
    while busy(state) > BUSY and oldest:
        ops.free(state, oldest.pop(0), now)
    if not granted:  # a waiting run is cancelled, another submitted
        granted = [state.queue.pop(rng.randrange(len(state.queue)))]
    state.queue += [mix.like(request, now) for request in granted]


# --- the naive baseline ------------------------------------------------------------------------


def naive_place(request: GangRequest, nodes: Iterable[tuple[NodeInfo, int]]) -> list[str] | None:
    """First fit by a linear scan of every node: whole idle nodes for a gang."""
    chosen = []
    for info, free in nodes:
        if request.gpu_type is not None and info.gpu_type != request.gpu_type:
            continue
        if request.nodes == 1:
            if free >= request.gpus_per_node:
                return [info.node_id]
        elif free == info.gpus and info.gpus >= request.gpus_per_node:
            chosen.append(info.node_id)
            if len(chosen) == request.nodes:
                return chosen
    return None


def naive_pass(state: ClusterState) -> int:
    """Order by priority and age, first-fit every request, book what fits. Returns grants."""
    free = {n.info.node_id: n.free for n in state.nodes if n.schedulable}
    infos = [n.info for n in state.nodes if n.schedulable]
    grants = 0
    for request in sorted(state.queue, key=lambda r: (-r.priority, r.submitted_at or START)):
        placed = naive_place(request, ((info, free[info.node_id]) for info in infos))
        if placed is None:
            continue
        grants += 1
        for node_id in placed:
            free[node_id] = 0 if request.nodes > 1 else free[node_id] - request.gpus_per_node
    return grants


# --- measuring ---------------------------------------------------------------------------------


def size_class(request: GangRequest) -> str:
    if request.nodes == 1:
        return f"{request.gpus_per_node} GPU{'s' if request.gpus_per_node > 1 else ''} (1 node)"
    if request.nodes >= 512:
        return "4,096 GPUs (512 nodes)"
    return "64-248 GPUs (8-31 nodes)" if request.nodes < 32 else "256-1,024 GPUs (32-128 nodes)"


CLASS_ORDER = [
    "1 GPU (1 node)",
    "2 GPUs (1 node)",
    "4 GPUs (1 node)",
    "8 GPUs (1 node)",
    "64-248 GPUs (8-31 nodes)",
    "256-1,024 GPUs (32-128 nodes)",
    "4,096 GPUs (512 nodes)",
]


@dataclass
class Row:
    label: str
    ours: list[float]  # seconds
    naive: list[float]


def pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def timed(fn: Callable[..., T], *args: object) -> tuple[float, T]:
    started = time.perf_counter()
    result = fn(*args)
    return time.perf_counter() - started, result


def place_rows(state: ClusterState, repeats: int) -> list[Row]:
    """`place()` alone for every pending request, on the pass's general capacity (no spares)."""
    nodes = [(n.info, n.free) for n in state.nodes if n.schedulable and not n.spare]
    capacity = Capacity(nodes)
    ours: dict[str, list[float]] = {c: [] for c in CLASS_ORDER}
    naive: dict[str, list[float]] = {c: [] for c in CLASS_ORDER}
    for _ in range(repeats):
        for request in state.queue:
            ours[size_class(request)].append(timed(place, request, capacity)[0])
            naive[size_class(request)].append(timed(naive_place, request, nodes)[0])
    return [
        Row(f"place(): {c}  n={len(ours[c]) // repeats}", ours[c], naive[c])
        for c in CLASS_ORDER
        if ours[c]
    ]


def describe(state: ClusterState) -> str:
    hours = {c: 0.0 for c in CLASS_ORDER}
    counts = {c: 0 for c in CLASS_ORDER}
    for r in state.queue:
        hours[size_class(r)] += r.gpus * (r.max_runtime_s or 0) / 3600
        counts[size_class(r)] += 1
    total = sum(hours.values())
    mix = ", ".join(f"{counts[c]} x {c} ({hours[c] / total:.0%} GPU-h)" for c in CLASS_ORDER)
    return (
        f"load: {busy(state):.1%} of GPUs busy in {len(state.allocations):,} running "
        f"allocations; {len(state.queue):,} pending:\n  {mix}"
    )


def fmt_ms(seconds: float) -> str:
    ms = seconds * 1000
    return f"{ms:10.3f}" if ms < 10 else f"{ms:10.1f}"


def table(rows: list[Row]) -> str:
    header = (
        f"{'':44} {'median ms':>10} {'p99 ms':>10} {'naive med':>10} {'naive p99':>10} "
        f"{'naive/ours':>10}"
    )
    lines = [header, "-" * len(header)]
    for row in rows:
        cells = (
            f"{row.label:44} {fmt_ms(statistics.median(row.ours))} {fmt_ms(pct(row.ours, 0.99))}"
        )
        if row.naive:
            ratio = statistics.median(row.naive) / statistics.median(row.ours)
            cells += (
                f" {fmt_ms(statistics.median(row.naive))} {fmt_ms(pct(row.naive, 0.99))}"
                f" {ratio:9.3g}x"
            )
        lines.append(cells)
    return "\n".join(lines)


class World:
    """The benchmark's cluster between passes: the state, its clock and what to perturb."""

    def __init__(self, state: ClusterState, rng: random.Random, mix: Mix) -> None:
        self.state, self.rng, self.mix = state, rng, mix
        self.now = START
        self.granted: list[GangRequest] = []
        self._decay()

    def _decay(self) -> None:
        ops.prepare(self.state, self.now)

    def advance(self) -> None:
        """Everything the workflow does before `schedule`, and the world's moves since."""
        self.now += timedelta(seconds=30)
        perturb(self.state, self.rng, self.mix, self.now, self.granted)
        self._decay()

    def apply(self, decisions: Decisions) -> None:
        ops.apply(self.state, decisions, self.now)
        self.granted = [request for request, _ in decisions.grants]


def profile(world: World, passes: int, top: int) -> str:
    """cProfile of `schedule` alone over `passes` more passes (the world moves as measured)."""
    profiler = cProfile.Profile()
    for _ in range(passes):
        world.advance()
        profiler.enable()
        decisions = schedule(world.state, world.now)
        profiler.disable()
        world.apply(decisions)
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    stats.sort_stats("tottime").print_stats(top)
    lines = out.getvalue().splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith("ncalls"))
    # What the victim search costs in all: it is invisible in own times (copies, placements).
    victims = sum(row[3] for (_, _, name), row in stats.stats.items() if name == "choose_victims")
    total = stats.total_tt
    summary = (
        f"{total:.2f} s in schedule() over {passes} passes (profiled), of which "
        f"choose_victims (cumulative) {victims:.2f} s = {victims / total:.0%}"
    )
    table_lines = [line.replace(str(REPO) + "/", "") for line in lines[start:] if line]
    return "\n".join([summary, *table_lines])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--passes", type=int, default=60)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--place-repeats", type=int, default=3)
    parser.add_argument("--profile-passes", type=int, default=10, help="0: no profile")
    args = parser.parse_args(argv)

    rng = random.Random(args.seed)
    mix = Mix(rng)
    built, state = timed(initial_state, rng, mix)
    pods = len({n.info.pod for n in state.nodes})
    print(
        f"cluster: {NODES:,} nodes x {GPUS_PER_NODE} GPUs = {NODES * GPUS_PER_NODE:,} GPUs in "
        f"{pods} pods of {POD_SIZE} ({A100_PODS} pods a100, the rest h100), "
        f"{len(state.config.queues)} queues, {state.config.spare_nodes} spares "
        f"(built in {built:.1f} s)"
    )
    print(describe(state))

    world = World(state, rng, mix)
    # One unmeasured pass: it grants the backlog of the synthetic start, not a steady state.
    world.apply(schedule(state, world.now))
    passes, per_decision, naive_passes = [], [], []
    grants = preemptions = 0
    seen_busy = []
    for _ in range(args.passes):
        world.advance()
        seen_busy.append(busy(state))
        considered = len(state.queue)
        seconds, decisions = timed(schedule, state, world.now)
        naive_seconds, _ = timed(naive_pass, state)
        passes.append(seconds)
        per_decision.append(seconds / considered)
        naive_passes.append(naive_seconds)
        grants += len(decisions.grants)
        preemptions += len(decisions.preemptions)
        world.apply(decisions)
    world.advance()  # the state as the next pass would see it: for place() alone
    print(
        f"passes: {args.passes} measured after one warm-up; before each, the earliest runs finish "
        f"down to {BUSY:.0%} busy, a request like each one granted arrives, 30 s pass, usage "
        f"decays; after each, its decisions are applied"
    )
    print(
        f"as the passes saw it: {statistics.mean(seen_busy):.1%} busy, {PENDING:,} pending; "
        f"they made {grants / args.passes:.1f} grants and {preemptions / args.passes:.1f} "
        f"preemptions each"
    )
    print(describe(state))
    print()
    rows = [
        Row("full pass: schedule(state, now)", passes, naive_passes),
        Row("per decision: pass / requests considered", per_decision, []),
        *place_rows(state, args.place_repeats),
    ]
    print(table(rows))
    median_ms = statistics.median(per_decision) * 1000
    verdict = "MET" if median_ms <= TARGET_MS else "NOT MET"
    print(
        f"\ntarget <= {TARGET_MS:g} ms median per decision: {verdict} ({median_ms:.3f} ms; "
        f"a whole pass over {PENDING:,} requests: {statistics.median(passes) * 1000:.0f} ms "
        f"median, {pct(passes, 0.9) * 1000:.0f} ms p90, {pct(passes, 0.99) * 1000:.0f} ms p99, "
        f"{max(passes) * 1000:.0f} ms max)"
    )
    print(
        "naive baseline: a linear first-fit scan per request (naive/ours > 1: ours is faster). "
        "Its pass only orders and places\n(no quotas, preemption, backfill or spares); its "
        "first fit stops at the first node that fits, which at 30 % free is near the front"
    )
    if args.profile_passes:
        print(
            f"\nwhere the time goes: cProfile of schedule() over {args.profile_passes} more "
            f"passes, top 15 by own time"
        )
        print(profile(world, args.profile_passes, 15))


if __name__ == "__main__":
    main()
