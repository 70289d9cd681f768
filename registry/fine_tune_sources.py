"""Which registered versions a team may fine-tune from (`model.init_from = "models:/…"`).

Every version of its own team's models, and of another team's model only a version that
model's approval gate approved: a candidate (or a rejected version) is that team's work, and
`init_from` would hand its weights to anyone who names it, without a line of code. A model that
predates teams has no team to match and counts as another team's.
"""

from __future__ import annotations

from mlflow.tracking import MlflowClient

from registry.errors import ModelOfAnotherTeam
from registry.names import DECISION_TAG
from registry.tracking import checkpoint_of, lookup_version, model_team

# DECISION_TAG's value on a version the gate approved (registry.tracking.record_decision).
APPROVED = "approved"


def model_name_of(uri: str) -> str:
    """NAME of models:/NAME/VERSION or models:/NAME@ALIAS (the spec has checked the form)."""
    return uri.removeprefix("models:/").split("@", 1)[0].rsplit("/", 1)[0]


def readable_checkpoint(tracking_uri: str, uri: str, team: str | None) -> tuple[str, str]:
    """(version, checkpoint manifest key) of the version `uri` names now, when a run of `team`
    may start from it; ModelOfAnotherTeam when it may not (VersionNotFound as checkpoint_of).
    `team` None: a run started before runs said their team, which is not checked."""
    version, key = checkpoint_of(tracking_uri, uri)
    if team is None:
        return version, key
    name = model_name_of(uri)
    client = MlflowClient(tracking_uri=tracking_uri)
    owner = model_team(client, name)
    if owner == team:
        return version, key
    # The version the alias named a moment ago: an alias moved since names another version,
    # which is checked when the run resolves it (the resolve_init_from activity).
    found = lookup_version(client, name, version=version)
    if found is not None and found.tags.get(DECISION_TAG) == APPROVED:
        return version, key
    decision = found.tags.get(DECISION_TAG, "none") if found is not None else "none"
    raise ModelOfAnotherTeam(
        f"model.init_from {uri!r}: model {name!r} belongs to "
        f"{f'team {owner!r}' if owner else 'no team'} and its version {version} was not "
        f"approved (decision: {decision}); a run of team {team!r} may start from its own "
        "team's models, or from a version another team's approval gate approved"
    )
