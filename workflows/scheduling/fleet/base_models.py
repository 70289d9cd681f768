"""Base models on the simulated nodes: each node's cache of them, what a fine-tune's gang must
fetch before it can start, and the hot pool's warming.

A node's cache holds base models up to `node_cache_gb`, the least recently used out first and
the hot ones last (as `infra.cache_budget` does); it advertises them in `NodeInfo.held`, so the
real placement (bytes to fetch) and the real hot pool (`workflows.scheduling.hot_pool`) see what
they see in the Cluster workflow. A gang starts when its slowest node has fetched the model.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from datetime import datetime

from workflows.contracts.cluster_models import Allocation, ClusterState, Node
from workflows.contracts.held_items import checkpoint_item
from workflows.scheduling import hot_pool
from workflows.scheduling.fleet.config import BaseModels

GB = 1e9


def manifest_key(model: int) -> str:
    return f"runs/base-{model:03d}/checkpoints/step-1/MANIFEST.json"


@dataclass
class FetchLedger:
    """What base models cost the runs and the pool, for the report."""

    start_fetch_s: list[float] = field(default_factory=list)  # a fine-tune's first attempt
    restart_fetch_s: list[float] = field(default_factory=list)  # later attempts that needed it
    fetched_by_runs_gb: float = 0.0  # GB copied while gangs waited (per node)
    warmed_gb: float = 0.0  # GB copied ahead of demand by the pool
    hot_gb_s: float = 0.0  # ∫ GB held for hot models over all nodes, dt
    hot_nodes_s: float = 0.0  # ∫ nodes holding a hot model, dt
    measured_s: float = 0.0


class NodeCaches:
    def __init__(self, nodes: list[Node], config: BaseModels, sizes_gb: list[float]) -> None:
        self.nodes = nodes
        self.config = config
        self.sizes_gb = sizes_gb
        self.items = [checkpoint_item(manifest_key(m)) for m in range(len(sizes_gb))]
        self.model_of = {item: m for m, item in enumerate(self.items)}
        self.held: list[OrderedDict[int, None]] = [OrderedDict() for _ in nodes]
        self.index_of = {n.info.node_id: i for i, n in enumerate(nodes)}
        self.ledger = FetchLedger()
        self._sampled_at = 0.0

    # --- what the engine asks -------------------------------------------------------------

    def request_fields(self, model: int, kept_s: float) -> dict[str, object]:
        """A fine-tune's request fields: until it has a checkpoint of its own it reads its base
        model (and says so in bytes, unless the placement compared is blind to it)."""
        if kept_s > 0:
            return {}
        fields: dict[str, object] = {"base_model": manifest_key(model)}
        if self.config.place_by_bytes:
            fields["needs"] = {self.items[model]: int(self.sizes_gb[model] * GB)}
        return fields

    def gang_granted(
        self, state: ClusterState, now: datetime, model: int, allocation: Allocation, attempt: int
    ) -> float:
        """Seconds the gang waits for `model` on its slowest node (attempt 1: its start); then
        every node of it holds the model."""
        indices = [self.index_of[n.node_id] for n in allocation.nodes]
        fetch_s = self.fetch_s(indices, model)
        (self.ledger.start_fetch_s if attempt == 1 else self.ledger.restart_fetch_s).append(fetch_s)
        hot = _hot(state, now)
        for index in indices:
            self.hold(index, model, hot)
        return fetch_s

    def after_pass(
        self, state: ClusterState, now_s: float, now: datetime, warmup_s: float
    ) -> list[tuple[float, int, str]]:
        """What the pool holds is sampled; the nodes it tells to warm, as (when each holds
        the model, node index, model id)."""
        self.sample(now_s, _hot(state, now), warmup_s)
        if not hot_pool.on(state):
            return []
        return [
            (now_s + self.sizes_gb[self.model_of[w.item]] / self.config.fetch_gb_per_s,
             self.index_of[w.node_id], w.item)
            for w in hot_pool.warm_plan(state, now)
        ]  # fmt: skip

    def warmed(self, state: ClusterState, index: int, item: str, now: datetime) -> None:
        """A node told to warm holds the model now (and is warming no more)."""
        state.warming.pop(self.nodes[index].info.node_id, None)
        self.ledger.warmed_gb += self.sizes_gb[self.model_of[item]]
        self.hold(index, self.model_of[item], _hot(state, now))

    # --- the caches -----------------------------------------------------------------------

    def fetch_s(self, indices: list[int], model: int) -> float:
        """Seconds until every node of a gang holds `model`: the slowest's copy."""
        missing = [i for i in indices if model not in self.held[i]]
        self.ledger.fetched_by_runs_gb += len(missing) * self.sizes_gb[model]
        return self.sizes_gb[model] / self.config.fetch_gb_per_s if missing else 0.0

    def hold(self, index: int, model: int, hot: set[str]) -> None:
        """`model` is on node `index` now (fetched or used): most recently used, and room is
        made from the least recently used cold models first, then the hot ones."""
        cache = self.held[index]
        cache[model] = None
        cache.move_to_end(model)
        while sum(self.sizes_gb[m] for m in cache) > self.config.node_cache_gb and len(cache) > 1:
            cold = [m for m in cache if m != model and self.items[m] not in hot]
            others = cold or [m for m in cache if m != model]
            del cache[others[0]]  # the first is the least recently used
        self.nodes[index].info.held = {
            self.items[m]: int(self.sizes_gb[m] * GB) for m in reversed(cache)
        }

    def sample(self, now_s: float, hot: set[str], from_s: float) -> None:
        """Integrate what the hot models take on the nodes up to `now_s` (after `from_s`)."""
        span = now_s - max(self._sampled_at, from_s)
        self._sampled_at = now_s
        if span <= 0:
            return
        models = {self.model_of[item] for item in hot if item in self.model_of}
        gb = nodes = 0.0
        for cache in self.held:
            on = models.intersection(cache)
            gb += sum(self.sizes_gb[m] for m in on)
            nodes += bool(on)
        self.ledger.hot_gb_s += gb * span
        self.ledger.hot_nodes_s += nodes * span
        self.ledger.measured_s += span


def _hot(state: ClusterState, now: datetime) -> set[str]:
    return set(hot_pool.targets(state, now))


@dataclass(frozen=True)
class FetchFigures:
    """The report's view of base models: how long gangs waited for them, and what the hot
    pool held and copied to spare them that."""

    starts: int
    start_p50_s: float
    start_p90_s: float
    start_mean_s: float
    restarts: int  # attempts after the first that still needed the base model
    restart_mean_s: float
    fetched_by_runs_tb: float
    warmed_tb: float
    hot_tb_held: float  # mean over the measured time, on all nodes together
    hot_nodes_held: float  # mean nodes holding a hot model

    @classmethod
    def of(cls, ledger: FetchLedger, percentile) -> FetchFigures:
        starts, restarts = ledger.start_fetch_s, ledger.restart_fetch_s
        span = ledger.measured_s or 1.0
        return cls(
            starts=len(starts),
            start_p50_s=percentile(starts, 50),
            start_p90_s=percentile(starts, 90),
            start_mean_s=sum(starts) / len(starts) if starts else 0.0,
            restarts=len(restarts),
            restart_mean_s=sum(restarts) / len(restarts) if restarts else 0.0,
            fetched_by_runs_tb=ledger.fetched_by_runs_gb / 1000,
            warmed_tb=ledger.warmed_gb / 1000,
            hot_tb_held=ledger.hot_gb_s / span / 1000,
            hot_nodes_held=ledger.hot_nodes_s / span,
        )
