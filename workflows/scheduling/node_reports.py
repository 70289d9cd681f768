"""When a run's word against a node takes it out of service.

A straggler swap and a corruption quarantine are found inside the ranks (the SDK's straggler
watch, its shadow checks and gradient watch), in the same process as the user's script, and
reach the agent as progress lines the script can write as well: they are the run's evidence,
not the platform's. So one run's report keeps that run's own gangs off the node
(`GangRequest.avoid`) and is recorded on the node, and the node is cordoned only when runs of
`ClusterConfig.cordon_teams` different teams have reported it within `cordon_window_h`: a script
alone cannot take nodes out of the cluster. What the agent itself finds (its health check, its
own death) takes a node down as before (`kind` unhealthy or fail-stop).

Pure functions on the Cluster workflow's state: no I/O, deterministic.
"""

from __future__ import annotations

from datetime import timedelta

from workflows.contracts.cluster_models import ClusterConfig, Node, NodeReport

# The kinds of NodeFailure a run's ranks are the only witness of.
RANK_REPORTED = frozenset({"straggler", "corruption"})


def reported(node: Node, report: NodeReport, config: ClusterConfig) -> list[NodeReport] | None:
    """Record `report` on the node; the reports that cordon it now (one of each of
    `cordon_teams` teams, within the window, the newest last), else None. A team's newer
    report replaces its older one: one team counts once, however many of its runs report, so
    a node keeps fewer reports than `cordon_teams` (at most 16)."""
    window = timedelta(hours=config.cordon_window_h)
    others = [r for r in node.reports if r.team != report.team and report.at - r.at <= window]
    node.reports = [*others, report]
    if len(node.reports) < config.cordon_teams:
        return None
    evidence, node.reports = node.reports, []  # the cordon's reason carries them from now on
    return evidence


def cordon_reason(evidence: list[NodeReport], config: ClusterConfig) -> str:
    """Why the node is cordoned: the report itself where one team's is enough (cordon_teams =
    1), else each team's."""
    if len(evidence) == 1:
        return evidence[0].reason
    each = "; ".join(f"team {r.team} (run {r.run_id}): {r.reason}" for r in evidence)
    return f"reported by runs of {len(evidence)} teams within {config.cordon_window_h:g} h: {each}"


def suspicion(node: Node, config: ClusterConfig) -> str:
    """What `forgeline nodes` says of a node reported but not cordoned ("" if none is)."""
    if not node.reports:
        return ""
    newest = node.reports[-1]
    more = f" and {len(node.reports) - 1} other team(s)" if len(node.reports) > 1 else ""
    return (
        f"reported: {newest.reason} (team {newest.team}, run {newest.run_id}{more}); cordoned "
        f"once runs of {config.cordon_teams} teams report it within {config.cordon_window_h:g} h"
    )
