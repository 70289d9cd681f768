"""Placement where the base model is, on the real stack: a fine-tune's node fetches the base
model it starts from into its cache and advertises it (with its bytes); the next fine-tune of the
same model goes to that node, though node ids and the dataset would pick another, and fetches
nothing, as the node's own cache records say. With the hot pool on, the idle nodes fetch the
model ahead of demand."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.e2e.conftest import Stack, variant, wait_for
from workflows.contracts.cluster_models import ClusterState
from workflows.contracts.held_items import checkpoint_folder_item

pytestmark = pytest.mark.e2e


def cluster(stack: Stack) -> ClusterState:
    return ClusterState.model_validate_json(stack.cli("nodes", "--json").stdout)


def trained_on(stack: Stack, run: str) -> set[str]:
    """The nodes whose agents ran a job of `run` (each keeps the job's folder)."""
    return {path.parents[1].name for path in (stack.home / "nodes").glob(f"*/runs/{run}")}


def cache_entries(stack: Stack, node: str) -> dict[str, dict]:
    index = stack.home / "nodes" / node / "cache" / "index.json"
    return json.loads(index.read_text())["entries"]


def fine_tune(tmp_path: Path, name: str) -> Path:
    path = variant(tmp_path, name, steps=10, checkpoint_every=10, nodes=1)
    text = path.read_text().replace(
        "[model]\n", '[model]\ninit_from = "models:/hot-base@candidate"\n'
    )
    path.write_text(text)
    return path


def to_approval(stack: Stack, spec: Path) -> None:
    followed = stack.cli("run", str(spec), timeout=300)
    assert "AWAITING_APPROVAL" in followed.stdout, followed.stdout


# Slow: three runs on the stack (about 60 s). In make test: placement by bytes to fetch
# (tests/workflows/scheduling/test_fetch_placement.py) and the cache's advertisement and fetch
# records (tests/activities/test_node_cache.py).
@pytest.mark.slow
def test_a_second_fine_tune_lands_on_the_node_that_holds_its_base_and_fetches_nothing(
    stack: Stack, tmp_path: Path
) -> None:
    to_approval(stack, variant(tmp_path, "hot-base", steps=20, checkpoint_every=20))
    nodes = sorted(n.info.node_id for n in cluster(stack).nodes if n.schedulable)
    holder, others = nodes[-1], nodes[:-1]
    # The first fine-tune can only go to the last node: it fetches the base model there.
    for node in others:
        stack.cli("node", "cordon", node)
    try:
        to_approval(stack, fine_tune(tmp_path, "hot-ft-1"))
    finally:
        for node in others:
            stack.cli("node", "undrain", node)
    assert trained_on(stack, "hot-ft-1") == {holder}
    before = cache_entries(stack, holder)
    (base,) = [rel for rel in before if rel.startswith("checkpoints/runs/hot-base/")]
    item = checkpoint_folder_item(base.removeprefix("checkpoints/"))
    held = {n.info.node_id: n.info.held for n in cluster(stack).nodes}
    assert held[holder][item] == before[base]["bytes"] > 0, held
    assert not any(item in held[node] for node in others), held
    # The base run's nodes hold its dataset too: by node id and dataset alone the next
    # fine-tune would go to the first of them.
    assert trained_on(stack, "hot-base") & set(others)

    started = time.time()
    to_approval(stack, fine_tune(tmp_path, "hot-ft-2"))
    assert trained_on(stack, "hot-ft-2") == {holder}
    after = cache_entries(stack, holder)
    fetched = sorted(rel for rel, entry in after.items() if entry["fetched_at"] >= started)
    assert fetched == [], f"fetched again on {holder}: {fetched}"
    assert after[base]["used"] > before[base]["used"]  # read from the cache, not fetched

    # The hot pool on: every node should hold the model the last runs asked for, so the idle
    # ones are told to fetch it, ahead of any run, and keep it over what is not hot.
    pool = tmp_path / "hot.toml"
    pool.write_text("hot_fraction = 1.0\n")
    stack.cli("cluster", "apply", str(pool))
    try:
        wait_for(
            lambda: all(item in n.info.held for n in cluster(stack).nodes if n.schedulable),
            120,
            "every node holding the base model",
        )
        queues = stack.cli("queues").stdout
        assert f"hot pool: {len(nodes)} of {len(nodes)} nodes hold a hot base model" in queues
        assert f"{item}: on {len(nodes)} of {len(nodes)} node(s)" in queues
        for node in others:
            index = json.loads((stack.home / "nodes" / node / "cache" / "index.json").read_text())
            assert index["hot"] == [base] and index["entries"][base]["fetched_at"] >= started
        assert "hot)" in stack.cli("nodes").stdout
    finally:
        pool.write_text("")
        stack.cli("cluster", "apply", str(pool))
