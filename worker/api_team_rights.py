"""What a submitter's team may ask of the cluster, checked at submission: a priority within
the team's allowance (the cluster file's `max_priority`). Every refusal is an `ApiError` that
names the field, the allowance and who may go past it."""

from __future__ import annotations

from temporalio.client import Client

from infra.identity import Identity
from worker.api_rules import ApiError
from worker.runs import cluster_state
from workflows.contracts.cluster_models import ClusterConfig
from workflows.contracts.spec import RunSpec

# The role that may submit above a team's allowance (infra.identity's role model).
PRIORITY_ROLE = "admin"


def refuse_priority_above_allowance(spec: RunSpec, who: Identity, config: ClusterConfig) -> None:
    """A run's priority is the first key the scheduler sorts every team's requests by: above
    its team's `max_priority` it would jump every other team's queue, so only an admin may
    submit it (403, naming the field, the allowance and the role)."""
    team, priority = spec.resources.team, spec.resources.priority
    allowance = config.queue(team).max_priority
    if priority <= allowance or who.is_admin:
        return
    raise ApiError(
        403,
        "forbidden",
        f"resources.priority = {priority} is above team {team!r}'s allowance of {allowance} "
        f"(max_priority of its queue in the cluster file): only the role {PRIORITY_ROLE} may "
        "submit above it",
        field="resources.priority",
        fix=f"lower resources.priority to {allowance} or less, or ask an admin to raise the "
        f"team's max_priority (forgeline cluster apply) or to submit the run",
    )


async def refuse_what_the_team_may_not(client: Client, spec: RunSpec, who: Identity) -> None:
    """The submission's team rights, before the run starts. Every allowance is at least 0, so
    a priority of 0 or less needs no look at the cluster's configuration."""
    if spec.resources.priority > 0 and not who.is_admin:
        config = (await cluster_state(client)).config
        refuse_priority_above_allowance(spec, who, config)
