"""The hot pool: a share of the nodes keeps the most requested base models on local disk, so a
fine-tune (and every restart of one) starts where its base model already is instead of copying
it from the store first.

- Demand: every request that names a base model (`GangRequest.base_model`) adds one to that
  model's weight, and weights halve every `hot_half_life_h`: the pool follows what is asked for
  now, not what was popular last month.
- The hot set: the `hot_models` models of highest weight.
- Targets: `hot_fraction` of the schedulable nodes should hold a hot model, shared among the hot
  models in proportion to their weight (each at least one node while there are nodes to give).
- Warming: idle nodes are told to fetch the model furthest below its target (`warm_cache` on
  the node), a few a pass, ahead of the runs that will ask. Placement then goes where the model
  is by itself (`placement`, bytes to fetch). A node keeps what is hot over what is not when its
  cache makes room (`infra.cache_budget`).

What it costs is disk on the holders and the copies made ahead of demand: `pool_view` says how
many nodes hold what, and the bytes held.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime, timedelta

from workflows.contracts.cluster_models import (
    ClusterState,
    GangRequest,
    ModelDemand,
    Node,
    Warming,
)
from workflows.contracts.held_items import checkpoint_item

# How long a node has to fetch a model before it is given up and planned again.
WARM_TIMEOUT = timedelta(minutes=30)
# The most nodes told to warm in one pass: copies of a 100 GB model to many nodes at once would
# crowd the store's bandwidth that starting runs need.
WARM_PER_PASS = 4
# Below this a model's weight is forgotten (one request decays there in about 10 half-lives).
_FORGOTTEN = 1e-3
# The most models whose demand is kept: the state travels in every continue-as-new.
_KEPT = 32


def on(state: ClusterState) -> bool:
    return state.config.hot_fraction > 0


def decayed(demand: ModelDemand, now: datetime, half_life_h: float) -> float:
    hours = max(0.0, (now - demand.at).total_seconds()) / 3600
    return demand.weight * 0.5 ** (hours / half_life_h)


def record_demand(state: ClusterState, request: GangRequest, now: datetime) -> None:
    """Count one request for the base model `request` starts from, if any: once a run (its
    first request; a restart is the same demand again)."""
    if request.base_model is None or request.started_before:
        return
    item = checkpoint_item(request.base_model)
    half_life = state.config.hot_half_life_h
    known = state.demand.get(item)
    weight = decayed(known, now, half_life) if known is not None else 0.0
    state.demand[item] = ModelDemand(
        manifest_key=request.base_model,
        bytes=request.needs.get(item, known.bytes if known else 0),
        weight=weight + 1.0,
        at=now,
    )
    if len(state.demand) > _KEPT:
        weakest = min(state.demand, key=lambda i: (decayed(state.demand[i], now, half_life), i))
        del state.demand[weakest]


def hot_set(state: ClusterState, now: datetime) -> list[tuple[str, float]]:
    """The hot models, by id with their weight now, the most requested first."""
    half_life = state.config.hot_half_life_h
    weights = [(item, decayed(d, now, half_life)) for item, d in state.demand.items()]
    weights = [(item, w) for item, w in weights if w >= _FORGOTTEN]
    return sorted(weights, key=lambda iw: (-iw[1], iw[0]))[: state.config.hot_models]


def targets(state: ClusterState, now: datetime) -> dict[str, int]:
    """How many nodes should hold each hot model: `hot_fraction` of the schedulable nodes,
    split by weight (largest remainders), each hot model at least one while nodes last."""
    hot = hot_set(state, now)
    pool = math.floor(state.config.hot_fraction * sum(n.schedulable for n in state.nodes))
    if not hot or pool == 0:
        return {}
    total = sum(w for _, w in hot)
    shares = {item: pool * w / total for item, w in hot}
    counts = {item: max(1, math.floor(share)) for item, share in shares.items()}
    by_remainder = sorted(hot, key=lambda iw: (-(shares[iw[0]] % 1), iw[0]))
    for item, _ in by_remainder:
        if sum(counts.values()) >= pool:
            break
        counts[item] += 1
    while sum(counts.values()) > pool:  # the "at least one" overshot: the least wanted give way
        item = next(i for i, _ in reversed(hot) if counts[i] > 0)
        counts[item] -= 1
    return {item: count for item, count in counts.items() if count}


@dataclass(frozen=True)
class Warm:
    node_id: str
    item: str
    manifest_key: str


def _holders(state: ClusterState, item: str) -> set[str]:
    held = {n.info.node_id for n in state.nodes if n.schedulable and item in n.info.holdings}
    return held | {node for node, w in state.warming.items() if w.item == item}


def warm_plan(state: ClusterState, now: datetime) -> list[Warm]:
    """The nodes to warm this pass, and with what: idle, active, not spare, not warming, and
    holding no hot model yet (a pool of one model a node covers the most nodes); the model
    furthest below its target first."""
    state.warming = {n: w for n, w in state.warming.items() if w.until > now}
    wanted = targets(state, now)
    hot = set(wanted)
    short = {item: count - len(_holders(state, item)) for item, count in wanted.items()}
    idle = sorted(
        (n for n in state.nodes if _may_warm(n, state, hot)), key=lambda n: n.info.node_id
    )
    plan: list[Warm] = []
    for node in idle:
        if len(plan) >= WARM_PER_PASS:
            break
        item, missing = max(short.items(), key=lambda im: (im[1], im[0]), default=("", 0))
        if missing <= 0:
            break
        short[item] -= 1
        plan.append(Warm(node.info.node_id, item, state.demand[item].manifest_key))
    for warm in plan:
        state.warming[warm.node_id] = Warming(item=warm.item, until=now + WARM_TIMEOUT)
    return plan


def _may_warm(node: Node, state: ClusterState, hot: set[str]) -> bool:
    return (
        node.schedulable
        and not node.spare
        and not node.jobs
        and node.info.node_id not in state.warming
        and not hot & node.info.holdings.keys()
    )


@dataclass(frozen=True)
class PoolView:
    """The pool as people see it: per hot model its holders against its target, and the
    disk it takes on them."""

    models: list[tuple[str, int, int, int]]  # (id, holders, target, bytes held on all holders)
    nodes_holding: int
    schedulable: int
    warming: int

    @property
    def bytes_held(self) -> int:
        return sum(held for *_, held in self.models)


def pool_view(state: ClusterState, now: datetime) -> PoolView:
    wanted = targets(state, now)
    rows = []
    holding: set[str] = set()
    for item, target in sorted(wanted.items(), key=lambda it: (-it[1], it[0])):
        holders = [n for n in state.nodes if n.schedulable and item in n.info.holdings]
        holding |= {n.info.node_id for n in holders}
        held = sum(n.info.holdings[item] for n in holders)
        rows.append((item, len(holders), target, held))
    return PoolView(
        models=rows,
        nodes_holding=len(holding),
        schedulable=sum(n.schedulable for n in state.nodes),
        warming=len(state.warming),
    )
