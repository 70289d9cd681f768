"""Random clusters, queue trees, request streams and failures for the policy properties.

A `Scenario` is what one property test runs through
`tests.workflows.scheduling.simulation.Simulator`:
1-40 nodes of 1/2/4/8 GPUs in 1-5 pods with 1-3 GPU types (maybe spares), a queue tree that
`ClusterConfig` accepts, requests and node failures/drains over a horizon.
"""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st

from tests.workflows.scheduling.policy_fixtures import NOW, node
from tests.workflows.scheduling.simulation import Arrival, NodeEvent, Simulator
from workflows.contracts.cluster_models import (
    DEFAULT_QUEUE,
    Admin,
    Allocation,
    ClusterConfig,
    ClusterState,
    GangRequest,
    Node,
    QueueConfig,
)

GPU_COUNTS = [1, 2, 4, 8]
GPU_TYPES = ["h100", "a100", "l40"]
SETTINGS = settings(
    max_examples=40,
    deadline=None,
    database=None,  # nothing written into the repository
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    # The same examples on every run, so CI is never red by chance; set
    # FORGELINE_EXPLORE=1 to let hypothesis search new ones.
    derandomize=not os.environ.get("FORGELINE_EXPLORE"),
)
# Regressions: no shrinking (a long simulation shrinks for minutes; the minimal example that
# once failed is given explicitly and runs first).
REGRESSION_SETTINGS = settings(SETTINGS, phases=[Phase.explicit, Phase.reuse, Phase.generate])


@dataclass
class Scenario:
    state: ClusterState
    arrivals: list[Arrival] = field(default_factory=list)
    node_events: list[NodeEvent] = field(default_factory=list)
    seed: int = 0
    never_release: float = 0.0

    def simulator(self, **hooks: object) -> Simulator:
        return Simulator(
            self.state.model_copy(deep=True),
            self.arrivals,
            self.node_events,
            seed=self.seed,
            never_release=self.never_release,
            **hooks,  # type: ignore[arg-type]
        )


# --- strategies --------------------------------------------------------------------------------


@st.composite
def cluster_nodes(draw: st.DrawFn, min_nodes: int = 1, max_nodes: int = 40) -> list[Node]:
    count = draw(st.integers(min_nodes, max_nodes))
    pods = draw(st.integers(1, 5))
    kinds = GPU_TYPES[: draw(st.integers(1, 3))]
    shapes = draw(
        st.lists(
            st.tuples(
                st.integers(0, pods - 1), st.sampled_from(kinds), st.sampled_from(GPU_COUNTS)
            ),
            min_size=count,
            max_size=count,
        )
    )
    return [
        node(f"n{i:02d}", pod=f"p{pod}", gpus=gpus, gpu_type=kind)
        for i, (pod, kind, gpus) in enumerate(shapes)
    ]


def gpu_counts(low: int, high: int) -> st.SearchStrategy[int]:
    """Between low and high, often near low: small ceilings and guarantees are where it bites."""
    high = max(low, high)
    return st.integers(low, min(high, low + 16)) | st.integers(low, high)


@st.composite
def queue_trees(draw: st.DrawFn, total_gpus: int) -> list[QueueConfig]:
    """Orgs with teams under them, and standalone teams; children's guarantees fit the parent's."""

    def queue(name: str, parent: str | None, guarantee: int) -> QueueConfig:
        ceiling = draw(st.none() | gpu_counts(guarantee, total_gpus))
        return QueueConfig(name=name, parent=parent, guaranteed_gpus=guarantee, max_gpus=ceiling)

    queues = []
    for o in range(draw(st.integers(0, 2))):
        org = queue(f"org{o}", None, draw(gpu_counts(0, total_gpus)))
        queues.append(org)
        room = org.guaranteed_gpus
        for t in range(draw(st.integers(1, 3))):
            team = queue(f"team{o}{t}", org.name, draw(gpu_counts(0, room)))
            room -= team.guaranteed_gpus
            queues.append(team)
    for t in range(draw(st.integers(0, 2))):
        queues.append(queue(f"solo{t}", None, draw(gpu_counts(0, total_gpus))))
    return queues


@st.composite
def configs(draw: st.DrawFn, nodes: list[Node]) -> ClusterConfig:
    total = sum(n.info.gpus for n in nodes)
    return ClusterConfig(
        queues=draw(queue_trees(total)),
        spare_nodes=draw(st.sampled_from([0, 0, 0, 1, 2])),
        preemption_grace_s=draw(st.integers(30, 600)),
        default_max_runtime_h=draw(st.floats(0.25, 3.0)),
        aging_s=draw(st.floats(600, 7200)),
        fair_share_half_life_h=draw(st.floats(0.5, 48)),
    )


def teams_of(config: ClusterConfig) -> list[str]:
    parents = {q.parent for q in config.queues}
    leaves = [q.name for q in config.queues if q.name not in parents]
    return [*leaves, DEFAULT_QUEUE, "adhoc"]  # adhoc: undeclared, no guarantee, no ceiling


@st.composite
def gang_requests(draw: st.DrawFn, run_id: str, teams: list[str], kinds: list[str]) -> GangRequest:
    return GangRequest(
        run_id=run_id,
        nodes=draw(st.sampled_from([1, 1, 1, 1, 2, 2, 3, 4, 8])),
        gpus_per_node=draw(st.sampled_from(GPU_COUNTS)),
        team=draw(st.sampled_from(teams)),
        gpu_type=draw(st.none() | st.sampled_from(kinds)),
        priority=draw(st.integers(0, 3)),
        preemptible=draw(st.booleans()),
        max_runtime_s=draw(st.none() | st.floats(300, 3 * 3600)),
        allow_multi_pod=draw(st.booleans()),
    )


@st.composite
def node_disruptions(draw: st.DrawFn, nodes: list[Node], horizon_s: float) -> list[NodeEvent]:
    """Failures, cordons and drains, each undone later (so every node comes back)."""
    events = []
    for _ in range(draw(st.integers(0, 4))):
        target = draw(st.sampled_from(nodes)).info.node_id
        at = draw(st.floats(0, horizon_s))
        back = at + draw(st.floats(60, 3600))
        change = draw(st.sampled_from(["down", "draining", "cordoned"]))
        events.append(NodeEvent(at, target, change))
        events.append(NodeEvent(back, target, "up" if change == "down" else Admin.ACTIVE.value))
    return events


@st.composite
def scenarios(draw: st.DrawFn, max_nodes: int = 40, max_requests: int = 25) -> Scenario:
    nodes = draw(cluster_nodes(max_nodes=max_nodes))
    config = draw(configs(nodes))
    teams = teams_of(config)
    kinds = sorted({n.info.gpu_type for n in nodes})
    span_s = draw(st.floats(0, 4 * 3600))  # requests arrive over this long
    arrivals = [
        Arrival(draw(st.floats(0, span_s)), draw(gang_requests(f"r{i:03d}", teams, kinds)))
        for i in range(draw(st.integers(1, max_requests)))
    ]
    return Scenario(
        state=ClusterState(config=config, nodes=nodes),
        arrivals=arrivals,
        node_events=draw(node_disruptions(nodes, span_s + 3600)),
        seed=draw(st.integers(0, 2**16)),
        never_release=draw(st.sampled_from([0.0, 0.0, 0.3, 1.0])),
    )


def hold(
    state: ClusterState,
    node_ids: list[str],
    gpus_per_node: int,
    team: str,
    priority: int = 0,
    granted: datetime = NOW - timedelta(minutes=1),
    hours_left: float = 10.0,
    preemptible: bool = True,
    checkpointed: datetime | None = None,
) -> None:
    """A running gang, granted at `granted`, as the workflow books it."""
    run_id = f"held{len(state.allocations):02d}"
    by_id = {n.info.node_id: n for n in state.nodes}
    for node_id in node_ids:
        by_id[node_id].jobs[run_id] = gpus_per_node
    state.allocations.append(
        Allocation(
            run_id=run_id,
            generation=state.next_generation,
            nodes=[by_id[i].info for i in node_ids],
            gpus_per_node=gpus_per_node,
            team=team,
            priority=priority,
            preemptible=preemptible,
            granted_at=granted,
            expected_end=NOW + timedelta(hours=hours_left),
            last_checkpoint_at=checkpointed or granted,
        )
    )
    state.next_generation += 1


def fill(
    draw: st.DrawFn,
    state: ClusterState,
    teams: list[str],
    whole_nodes: bool = False,
    rigid: bool = False,
) -> None:
    """Every GPU held: gangs over runs of equal nodes, or jobs sharing one node (unless
    `whole_nodes`), of random teams, priorities and ages; some non-preemptible if `rigid`."""
    nodes = state.nodes
    rigid_gpus: dict[str, int] = defaultdict(int)  # non-preemptible GPUs held, by team

    def gang(node_ids: list[str], gpus_per_node: int) -> None:
        age_s = draw(st.integers(60, 3 * 3600))
        team = draw(st.sampled_from(teams))
        gpus = len(node_ids) * gpus_per_node
        # Reachable states only: the scheduler grants a non-preemptible gang only within its
        # team's guarantee, so a state with more is one it never made (a recovering gang of it
        # would then be granted "over" the guarantee it already held).
        fits = rigid_gpus[team] + gpus <= state.config.queue(team).guaranteed_gpus
        preemptible = not (rigid and draw(st.booleans()) and fits)
        if not preemptible:
            rigid_gpus[team] += gpus
        hold(
            state,
            node_ids,
            gpus_per_node,
            team=team,
            priority=draw(st.integers(0, 3)),
            granted=NOW - timedelta(seconds=age_s),
            hours_left=draw(st.floats(0.1, 6)),
            # any checkpoint age: the cheapest victim is then not always the youngest gang
            checkpointed=NOW - timedelta(seconds=draw(st.integers(0, age_s))),
            preemptible=preemptible,
        )

    i = 0
    while i < len(nodes):
        gpus = nodes[i].info.gpus
        same = 1
        while i + same < len(nodes) and nodes[i + same].info.gpus == gpus and same < 4:
            same += 1
        width = draw(st.integers(1, same))
        if width > 1 or whole_nodes:
            gang([n.info.node_id for n in nodes[i : i + width]], gpus)
        else:
            left = gpus
            while left:
                part = draw(st.sampled_from([g for g in GPU_COUNTS if g <= left]))
                gang([nodes[i].info.node_id], part)
                left -= part
        i += width


@st.composite
def contended(draw: st.DrawFn, span_s: float = 600) -> Scenario:
    """A full cluster shared by teams with guarantees, and more requests from all of them: where
    preemption has the most candidates to get wrong (own team, within guarantee, rigid)."""
    nodes = draw(cluster_nodes(max_nodes=16))
    room = sum(n.info.gpus for n in nodes)
    queues = []
    for name in ["alpha", "beta", "gamma"]:
        guarantee = draw(gpu_counts(0, room))
        room -= guarantee
        queues.append(QueueConfig(name=name, guaranteed_gpus=guarantee))
    config = ClusterConfig(
        queues=queues,
        preemption_grace_s=draw(st.integers(30, 600)),
        aging_s=draw(st.floats(600, 7200)),
        default_max_runtime_h=draw(st.floats(0.25, 2.0)),
    )
    state = ClusterState(config=config, nodes=nodes)
    teams = [q.name for q in queues]
    fill(draw, state, teams, rigid=True)
    kinds = sorted({n.info.gpu_type for n in nodes})
    arrivals = []
    for i in range(draw(st.integers(1, 15))):
        wanted = draw(gang_requests(f"r{i:03d}", teams, kinds))
        guarantee = config.queue(wanted.team).guaranteed_gpus
        if draw(st.booleans()):  # within its team's guarantee: it may reclaim
            shapes = [(k, g) for k in (1, 2, 3, 4) for g in GPU_COUNTS if k * g <= guarantee]
            if shapes:
                k, g = draw(st.sampled_from(shapes))
                wanted = wanted.model_copy(update={"nodes": k, "gpus_per_node": g})
        arrivals.append(Arrival(draw(st.floats(0, span_s)), wanted))
    return Scenario(
        state=state,
        arrivals=arrivals,
        node_events=draw(node_disruptions(nodes, span_s)),
        seed=draw(st.integers(0, 2**16)),
        never_release=draw(st.sampled_from([0.0, 0.0, 0.3, 1.0])),
    )


any_scenario = scenarios() | contended()


# --- what one pass must never do ---------------------------------------------------------------
