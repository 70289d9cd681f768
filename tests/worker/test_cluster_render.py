"""`forgeline jobs` and `nodes`: which gangs run on lent, reserved nodes, and where in the fabric
each gang landed or waits to."""

from __future__ import annotations

from rich.console import Console

from tests.workflows.scheduling.policy_fixtures import NOW, node, request, running
from worker.cluster_render import jobs_table, nodes_table
from workflows.contracts.cluster_models import ClusterConfig, ClusterState
from workflows.contracts.spec import RunSpec
from workflows.scheduling.cluster_ops import run_pass


def test_a_yielder_is_shown_with_the_run_it_leaves_for() -> None:
    state = ClusterState(config=ClusterConfig(), nodes=[node("n0"), node("n1")])
    running(state, "filler", ["n0"], yields_to="big")
    running(state, "plain", ["n1"])
    console = Console(record=True, width=200)
    console.print(jobs_table(state))
    lines = {line.split("│")[1].strip(): line for line in console.export_text().splitlines()
             if line.count("│") > 2}  # fmt: skip
    assert "lent: leaves when big can start" in lines["filler"]
    assert "lent" not in lines["plain"]


def _rows(table) -> dict[str, str]:
    console = Console(record=True, width=250)
    console.print(table)
    return {line.split("│")[1].strip(): line for line in console.export_text().splitlines()
            if line.count("│") > 2}  # fmt: skip


def test_jobs_say_which_unit_a_gang_landed_in_and_which_one_it_waits_for() -> None:
    layout = [("n1", "r1"), ("n2", "r1"), ("n3", "r2"), ("n4", "r2"), ("n5", "r2")]
    state = ClusterState(config=ClusterConfig(levels=["block", "rack"]))
    for name, rack in layout:
        each = node(name)
        each.info.topology = {"block": "b1", "rack": rack}
        state.nodes.append(each)
    state.queue = [
        request("pair", nodes=2, topology="rack"),
        request("trio", nodes=3, topology="rack", priority=-1),
        request("later", nodes=3, topology="rack", priority=-2),  # both racks are taken
    ]
    run_pass(state, NOW)
    jobs = _rows(jobs_table(state))
    assert "n1, n2 · rack p0/b1/r1" in jobs["pair"]  # the smaller rack that holds it
    assert "n3, n4, n5 · rack p0/b1/r2" in jobs["trio"]
    assert "waiting" in jobs["later"] and "3 node(s) in one rack reserved" in jobs["later"]
    nodes = _rows(nodes_table(state))
    assert "b1/r2" in nodes["n5"]


def test_jobs_show_the_layout_the_run_asked_for() -> None:
    """The gang's layout goes from its spec (RunSpec.layout_summary) through its request to its
    allocation: pipeline stages on neighbouring nodes of one unit, tensor inside a node."""
    spec = RunSpec.model_validate({
        "name": "three-d", "data": {"sources": ["x"]}, "model": {"n_layer": 4},
        "resources": {"nodes": 4, "gpus_per_node": 2, "topology": "rack"},
        "parallel": {"pipeline": 2, "shard": 2, "tensor": 2, "activation_checkpointing": "full"},
    })  # fmt: skip
    summary = spec.layout_summary()
    assert summary == "pipeline 2 (1F1B) × shard 2 × tensor 2, full recompute"
    state = ClusterState(config=ClusterConfig(levels=["rack"]))
    for name in ("n1", "n2", "n3", "n4"):
        each = node(name, gpus=2)
        each.info.topology = {"rack": "r1"}
        state.nodes.append(each)
    state.queue = [request("three-d", nodes=4, gpus_per_node=2, topology="rack", layout=summary)]
    run_pass(state, NOW)
    assert f"n1, n2, n3, n4 · rack p0/r1 · {summary}" in _rows(jobs_table(state))["three-d"]


def test_the_nodes_table_has_no_position_column_without_levels() -> None:
    state = ClusterState(config=ClusterConfig(), nodes=[node("n0")])
    console = Console(record=True, width=250)
    console.print(nodes_table(state))
    assert "position" not in console.export_text()


def test_the_nodes_table_says_how_each_node_runs_users_code() -> None:
    boxed, unconfined, refusing, older = (node(n) for n in ("n0", "n1", "n2", "n3"))
    boxed.info.confinement = "box"
    unconfined.info.confinement = "unconfined: started with --unconfined-user-code by its operator"
    refusing.info.confinement = "refuses user code: bwrap is not installed (apt-get install …)"
    state = ClusterState(config=ClusterConfig(), nodes=[boxed, unconfined, refusing, older])
    rows = _rows(nodes_table(state))
    assert "boxed" in rows["n0"] and "UNCONFINED" in rows["n1"]
    assert "refuses user code" in rows["n2"] and "│ ?" in rows["n3"]  # an agent from before


def test_jobs_packed_on_one_node_say_which_of_its_gpus_each_holds() -> None:
    state = ClusterState(config=ClusterConfig(spare_nodes=0), nodes=[node("n0")])
    state.queue = [request("four", gpus_per_node=4), request("one", gpus_per_node=1)]
    run_pass(state, NOW)
    jobs = _rows(jobs_table(state))
    assert "on n0 (GPUs 0-3)" in jobs["four"]
    assert "on n0 (GPU 4)" in jobs["one"]
