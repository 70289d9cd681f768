"""Fair share, as properties of the pure scheduling pass and of usage decaying over time.

Among requests of equal priority and age, the team whose decayed usage is lowest relative to its
guarantee goes first; a team that just ran a huge job yields to the others for a while and then
recovers as its usage decays. The run ids are chosen so that the tie-breaks after fair share (age,
then run id) would give a different answer: a pass that ignored fair share fails these.
"""

from __future__ import annotations

import math
from datetime import timedelta

from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from tests.workflows.scheduling.policy_fixtures import NOW, node, request, teams
from workflows.contracts.cluster_models import ClusterState
from workflows.scheduling import cluster_ops as ops
from workflows.scheduling.scheduler import schedule

HOUR = 3600.0
GPUS_PER_NODE = 8  # the fixtures' nodes and requests


def _share(state: ClusterState, team: str) -> float:
    """The rule, written out here: decayed usage per guaranteed GPU (a team without a
    guarantee counts as guaranteed one)."""
    return state.usage.get(team, 0.0) / max(1, state.config.queue(team).guaranteed_gpus)


@st.composite
def contending_teams(draw: st.DrawFn) -> tuple[ClusterState, int]:
    """Teams of equal priority and age, one one-node request each, fewer idle nodes than teams."""
    count = draw(st.integers(2, 6))
    guarantees = draw(st.lists(st.integers(0, 64), min_size=count, max_size=count))
    usage = draw(st.lists(st.floats(0, 1e7, allow_nan=False), min_size=count, max_size=count))
    # The run ids' alphabetical order is drawn apart from the usage order.
    names = draw(st.permutations([f"r{i}" for i in range(count)]))
    free_nodes = draw(st.integers(1, count - 1))
    config = teams(**{f"t{i}": (g, None) for i, g in enumerate(guarantees)})
    state = ClusterState(
        config=config,
        nodes=[node(f"n{i}") for i in range(free_nodes)],
        queue=[request(names[i], team=f"t{i}") for i in range(count)],
        usage={f"t{i}": u for i, u in enumerate(usage)},
        usage_at=NOW,
    )
    keys = [_share(state, f"t{i}") for i in range(count)]
    assume(len(set(keys)) == count)  # a tie would be broken by age, then run id
    return state, free_nodes


@settings(max_examples=150, deadline=None)
@given(contending_teams())
@example(  # equal usage: the team with the bigger guarantee is further below it
    (
        ClusterState(
            config=teams(small=(8, None), large=(64, None)),
            nodes=[node("n0")],
            queue=[request("a", team="small"), request("b", team="large")],
            usage={"small": 1e5, "large": 1e5},
            usage_at=NOW,
        ),
        1,
    )
)
def test_the_team_furthest_below_its_guarantee_goes_first(case: tuple[ClusterState, int]) -> None:
    state, free_nodes = case
    decisions = schedule(state, NOW)
    granted = {r.team for r, _ in decisions.grants}
    by_key = sorted(
        (r.team for r in state.queue),
        key=lambda team: _share(state, team),
    )
    assert granted == set(by_key[:free_nodes])


def _hour_of_grants(state: ClusterState, now, requests_each: int) -> dict[str, int]:
    """One hour of the cluster: every gang of the last hour ends, each team asks again for
    `requests_each` one-node jobs (all submitted now: equal age), and one pass places them."""
    for allocation in list(state.allocations):
        ops.free(state, allocation, now)
    state.queue = [
        request(f"{prefix}-{now:%j%H}-{i}", team=team, submitted_at=now)
        for team, prefix in (("big", "a"), ("small", "b"))  # "a…" sorts first: no help
        for i in range(requests_each)
    ]
    _, decisions, _ = ops.run_pass(state, now)
    granted = {"big": 0, "small": 0}
    for granted_request, _ in decisions.grants:
        granted[granted_request.team] += 1
    return granted


@settings(max_examples=25, deadline=None)
@given(
    huge_job_hours=st.floats(4, 96),
    half_life_h=st.floats(4, 48),
    nodes=st.integers(2, 6),
)
@example(huge_job_hours=48, half_life_h=24, nodes=4)
def test_a_team_that_ran_a_huge_job_yields_then_recovers(
    huge_job_hours: float, half_life_h: float, nodes: int
) -> None:
    # No guarantees: both teams borrow, so reclaiming a guarantee plays no part; what decides
    # is usage alone.
    config = teams(big=(0, None), small=(0, None))
    config.fair_share_half_life_h = half_life_h
    hour_of_cluster = nodes * GPUS_PER_NODE * HOUR  # GPU-seconds the whole cluster gives an hour
    huge = huge_job_hours * hour_of_cluster  # big just ran the whole cluster this long
    state = ClusterState(
        config=config,
        nodes=[node(f"n{i}") for i in range(nodes)],
        usage={"big": huge},
        usage_at=NOW,
    )
    grants = [
        _hour_of_grants(state, NOW + timedelta(hours=h), requests_each=nodes)
        for h in range(int(huge_job_hours * 2 + 6 * half_life_h))
    ]
    big_got = [g["big"] for g in grants]
    assert all(g["big"] + g["small"] == nodes for g in grants)  # the cluster never idles

    recovered = next((h for h, got in enumerate(big_got) if got), None)
    assert recovered is not None, f"big never ran again: {grants}"
    # It yields at least while its decayed usage is above all small could have run since...
    yields_at_least = next(
        h for h in range(len(grants)) if huge * 0.5 ** (h / half_life_h) < hour_of_cluster * h
    )
    # ...and at most until its usage decays below one hour of the whole cluster, which small
    # has run (at least) in the hour before.
    yields_at_most = math.ceil(half_life_h * math.log2(huge / hour_of_cluster)) + 1
    assert yields_at_least <= recovered <= yields_at_most, (recovered, big_got)

    # Recovered: over the next stretch the two teams share the cluster, as their usage is
    # equal by then, and neither is shut out for long.
    after = grants[recovered:]
    share = sum(g["big"] for g in after) / (nodes * len(after))
    assert 0.3 <= share <= 0.7, (share, big_got)
    turns = "".join("x" if got else "." for got in big_got[recovered:])
    longest_without = max(len(gap) for gap in turns.split("x"))
    assert longest_without <= half_life_h + 2
