"""A run's word against a node (workflows/scheduling/node_reports.py): a straggler or corruption
report comes from the ranks, where a user's script can write it, so one team's reports keep only
that team's run off the node (placement skips `GangRequest.avoid`), and the node is cordoned
when runs of `cordon_teams` teams report it within `cordon_window_h`."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from rich.console import Console

from tests.workflows.scheduling.policy_fixtures import request
from tests.workflows.scheduling.test_topology import capacity, racked
from worker.cluster_render import nodes_table
from workflows.contracts.cluster_models import (
    ClusterConfig,
    ClusterState,
    Node,
    NodeInfo,
    NodeReport,
)
from workflows.scheduling.node_reports import cordon_reason, reported, suspicion
from workflows.scheduling.placement import place

AT = datetime(2026, 12, 6, tzinfo=UTC)
CONFIG = ClusterConfig()  # cordon_teams 2, cordon_window_h 24


def _node() -> Node:
    return Node(info=NodeInfo(node_id="n1", rdzv_port=1, incarnation="i"))


def _report(team: str, run_id: str, hours: float = 0.0, kind: str = "corruption") -> NodeReport:
    return NodeReport(run_id=run_id, team=team, kind=kind, reason=f"{kind} seen by {run_id}",
                      at=AT + timedelta(hours=hours))  # fmt: skip


def test_one_team_however_many_runs_does_not_cordon_and_a_second_team_does() -> None:
    node = _node()
    assert reported(node, _report("a", "a1"), CONFIG) is None
    assert reported(node, _report("a", "a2", hours=1), CONFIG) is None  # team a counts once
    assert [r.run_id for r in node.reports] == ["a2"]
    assert "reported: corruption seen by a2 (team a, run a2)" in suspicion(node, CONFIG)
    evidence = reported(node, _report("b", "b1", hours=2, kind="straggler"), CONFIG)
    assert evidence is not None and [r.run_id for r in evidence] == ["a2", "b1"]
    assert node.reports == []  # the cordon's reason carries them from now on
    assert cordon_reason(evidence, CONFIG) == (
        "reported by runs of 2 teams within 24 h: team a (run a2): corruption seen by a2; "
        "team b (run b1): straggler seen by b1"
    )


def test_a_report_older_than_the_window_does_not_count() -> None:
    node = _node()
    reported(node, _report("a", "a1"), CONFIG)
    assert reported(node, _report("b", "b1", hours=25), CONFIG) is None
    assert [r.team for r in node.reports] == ["b"]


def test_a_cluster_that_trusts_every_run_cordons_on_one_report_as_before() -> None:
    trusting = ClusterConfig(cordon_teams=1)
    evidence = reported(_node(), _report("a", "a1"), trusting)
    assert evidence is not None and cordon_reason(evidence, trusting) == "corruption seen by a1"


def test_the_reports_kept_on_a_node_are_fewer_than_the_teams_a_cordon_needs() -> None:
    node = _node()
    for n in range(50):  # one team's runs, one after another: one report
        reported(node, _report("a", f"r{n}", hours=n / 10), CONFIG)
    assert [r.run_id for r in node.reports] == ["r49"]
    node, three = _node(), ClusterConfig(cordon_teams=3)
    for team in ("a", "b", "a", "b"):
        assert reported(node, _report(team, f"{team}-run"), three) is None
    assert len(node.reports) == 2 and reported(node, _report("c", "c1"), three) is not None


def test_placement_keeps_a_run_off_the_nodes_its_ranks_reported() -> None:
    nodes = [racked(f"n{i}") for i in range(3)]
    assert place(request("one", avoid=["n0"]), capacity(nodes)) == ["n1"]
    assert place(request("one"), capacity(nodes)) == ["n0"]
    chosen = place(request("gang", nodes=2, avoid=["n0"]), capacity(nodes))
    assert sorted(chosen or []) == ["n1", "n2"]
    assert place(request("gang", nodes=3, avoid=["n0"]), capacity(nodes)) is None


def test_forgeline_nodes_notes_a_reported_node_that_is_not_cordoned() -> None:
    node = _node()
    reported(node, _report("a", "a1"), CONFIG)
    console = Console(record=True, width=250)
    console.print(nodes_table(ClusterState(config=CONFIG, nodes=[node])))
    row = next(line for line in console.export_text().splitlines() if "│ n1 " in line)
    assert "idle" in row and "reported: corruption seen by a1 (team a, run a1); cordoned …" in row
