"""Fine-tunes and the hot pool in the datacenter simulation: the workload draws its fine-tunes
apart from everything else, a gang waits for its slowest node's copy of the base model, caches
keep hot models over cold ones, and with the pool on fine-tunes wait less for their base."""

from __future__ import annotations

from tests.workflows.scheduling.policy_fixtures import node
from tests.workflows.scheduling.test_fleet_sim import small
from workflows.scheduling.fleet.base_models import NodeCaches
from workflows.scheduling.fleet.config import BaseModels, SimConfig
from workflows.scheduling.fleet.report import hot_pool_steps, run
from workflows.scheduling.fleet.workload import jobs


def with_fine_tunes(config: SimConfig, **fields: object) -> SimConfig:
    bases = BaseModels(models=8, node_cache_gb=200, fine_tune_share=0.6, hot_fraction=0.5)
    return config.model_copy(update={"base_models": bases.model_copy(update=fields)})


def test_fine_tunes_are_drawn_apart_from_the_rest_of_the_workload() -> None:
    plain, tuned = jobs(small()), jobs(with_fine_tunes(small()))
    assert [(j.run_id, j.gpus, j.submit_s, j.work_s) for j in plain] == [
        (j.run_id, j.gpus, j.submit_s, j.work_s) for j in tuned
    ]
    bases = [j for j in tuned if j.base is not None]
    assert all(j.base is None for j in plain)
    assert bases and all(j.gpus <= 32 for j in bases)
    assert 0.4 < len(bases) / sum(j.gpus <= 32 for j in tuned) < 0.8
    assert {j.base for j in bases} <= set(range(8))


def test_a_gang_waits_for_its_slowest_copy_and_caches_keep_hot_models_last() -> None:
    config = BaseModels(fetch_gb_per_s=2.0, node_cache_gb=300)
    nodes = [node("n0"), node("n1")]
    caches = NodeCaches(nodes, config, sizes_gb=[100.0, 100.0, 100.0, 100.0])
    assert caches.fetch_s([0, 1], 0) == 50.0  # 100 GB at 2 GB/s
    caches.hold(0, 0, hot=set())
    assert caches.fetch_s([0], 0) == 0.0 and caches.fetch_s([0, 1], 0) == 50.0
    hot = {caches.items[0]}
    for model in (1, 2, 3):  # the fourth 100 GB model makes room on a 300 GB cache
        caches.hold(0, model, hot)
    assert list(caches.held[0]) == [0, 2, 3]  # model 0 was used first, but it is hot
    assert list(nodes[0].info.held) == [caches.items[m] for m in (3, 2, 0)]  # newest first
    caches.hold(0, 1, hot=set())  # nothing hot: the least recently used goes
    assert list(caches.held[0]) == [2, 3, 1]
    assert caches.ledger.fetched_by_runs_gb == 300.0  # the three copies fetch_s counted


def test_placement_by_bytes_then_the_pool_cut_the_wait_for_the_base() -> None:
    blind, by_bytes, pooled = hot_pool_steps(with_fine_tunes(small(days=4)))
    assert not blind.base_models.place_by_bytes and by_bytes.base_models.hot_fraction == 0
    assert pooled.base_models.hot_fraction == 0.5
    before, placed, within = (run(c).fetches for c in (blind, by_bytes, pooled))
    assert before is not None and placed is not None and within is not None
    assert before.start_mean_s > placed.start_mean_s > within.start_mean_s
    assert before.fetched_by_runs_tb > placed.fetched_by_runs_tb > within.fetched_by_runs_tb
    assert placed.warmed_tb == 0 and within.warmed_tb > 0
    assert 0 < within.hot_nodes_held <= 32
    assert run(pooled).fetches == within  # one seed, one answer
