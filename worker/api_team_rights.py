"""What a submitter's team may ask for and learn, checked at submission: a priority within the
team's allowance (the cluster file's `max_priority`); weights to start from (`model.init_from`)
that the team may read: its own runs' checkpoints, its own models' versions, or versions another
team approved; and, when a run's name is taken, which keys of the other spec differ, never its
values. After submission: a run's logs are its team's. Every refusal is an `ApiError` that names
the field and what to do."""

from __future__ import annotations

import asyncio

from temporalio.client import Client
from temporalio.service import RPCError, RPCStatusCode

from infra.identity import Identity
from infra.settings import Settings
from worker.api_rules import ApiError
from worker.runs import cluster_state, submitted_spec
from worker.specfile import differing_keys
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


def refuse_another_team_s_run(spec: RunSpec, run: str, team_of_run: str | None) -> None:
    """`model.init_from` names a checkpoint of `run` by its store key: only a run of the
    submitter's team may be started from so (`team_of_run` None: no run of that name is known,
    so whose it is cannot be told either)."""
    team = spec.resources.team
    if team_of_run == team:
        return
    whose = f"run {run!r} belongs to team {team_of_run!r}"
    if team_of_run is None:
        whose = f"no run {run!r} is known"
    raise ApiError(
        403,
        "forbidden",
        f"model.init_from {spec.model.init_from!r}: {whose}; a run of team {team!r} may start "
        "from its own team's runs' checkpoints, its team's registered models, or a version "
        "another team approved",
        field="model.init_from",
        fix="name a checkpoint of one of your team's runs, or a registered version "
        "(models:/NAME/VERSION) your team may read",
    )


async def _submitted(client: Client, run: str) -> RunSpec | None:
    """The spec `run` was submitted with, as Temporal recorded its start: its team and owner
    (None: no such run, or its history is gone)."""
    try:
        return await submitted_spec(client, run)
    except RPCError as err:
        if err.status != RPCStatusCode.NOT_FOUND:
            raise
        return None


async def _team_of_run(client: Client, run: str) -> str | None:
    """The team `run` was submitted to (None: no such run, or its history is gone)."""
    before = await _submitted(client, run)
    return before.resources.team if before is not None else None


def refuse_another_team_s_logs(run: str, who: Identity, submitted: RunSpec | None) -> None:
    """A run's logs are what its code printed, its data and its mistakes among it: they are read
    by its team (a role for it: submit:TEAM or approve:TEAM), its owner (whose code printed them,
    as they may cancel it whatever their roles now) and admins; `submitted` None (no run of that
    name, or its history is gone) leaves only admins, since whose they are cannot be told."""
    if who.is_admin:
        return
    if submitted is None:
        raise ApiError(
            403,
            "forbidden",
            f"whose run {run} is cannot be told (its history is gone, past the namespace's "
            "retention, or it was never started): only the role admin may read its logs",
            fix="ask an admin to read them",
        )
    team = submitted.resources.team
    if who.of_team(team) or who.person == submitted.owner:
        return
    raise ApiError(
        403,
        "forbidden",
        f"run {run}'s logs are team {team!r}'s: only its owner, a role for the team "
        f"(submit:{team} or approve:{team}) or the role admin may read them",
        fix=f"ask an admin for the role submit:{team} or approve:{team}, or ask someone of "
        f"team {team!r}",
    )


async def refuse_logs_of_another_team(client: Client, run: str, who: Identity) -> None:
    """refuse_another_team_s_logs, with whose `run` is from Temporal (not for an admin, who may
    read every run's logs whether or not Temporal answers)."""
    if not who.is_admin:
        refuse_another_team_s_logs(run, who, await _submitted(client, run))


async def _refuse_unreadable_version(settings: Settings, uri: str, team: str) -> None:
    """A registered version the team may not read is refused now rather than when the run
    resolves it, hours of queueing later. An MLflow that does not answer, or a version not
    there yet, is left to the run's own check (the resolve_init_from activity decides)."""
    # Here, not at the top: importing MLflow takes a second and most submissions never do.
    from mlflow.exceptions import MlflowException

    from registry.errors import ModelOfAnotherTeam, VersionNotFound
    from registry.fine_tune_sources import readable_checkpoint

    found = asyncio.to_thread(readable_checkpoint, settings.mlflow_uri, uri, team)
    try:
        # MLflow's client retries an unreachable server for minutes: a submit does not wait.
        await asyncio.wait_for(found, timeout=10)
    except (MlflowException, VersionNotFound, TimeoutError):
        return
    except ModelOfAnotherTeam as err:
        raise ApiError(
            403,
            "forbidden",
            str(err),
            field="model.init_from",
            fix="name a version of your team's models, or one another team approved",
        ) from None


async def refuse_what_the_team_may_not(
    client: Client, settings: Settings, spec: RunSpec, who: Identity
) -> None:
    """The submission's team rights, before the run starts: its priority (every allowance is
    at least 0, so 0 or less needs no look at the cluster's configuration) and the weights it
    starts from."""
    if spec.resources.priority > 0 and not who.is_admin:
        config = (await cluster_state(client)).config
        refuse_priority_above_allowance(spec, who, config)
    source = spec.model.init_from
    if source is None:
        return
    if source.startswith("models:/"):
        await _refuse_unreadable_version(settings, source, spec.resources.team)
    else:  # runs/RUN/checkpoints/…: the spec has checked the form
        run = source.split("/", 2)[1]
        refuse_another_team_s_run(spec, run, await _team_of_run(client, run))


def conflicting_spec(name: str, before: RunSpec | None, after: RunSpec) -> ApiError:
    """The 409 for a name taken by another spec: it names the keys that differ and not their
    values, since the run that holds the name may be another team's (its data sources, its
    model's shape are not the caller's to read)."""
    changed = differing_keys(before, after) if before is not None else []
    return ApiError(
        409,
        "conflict",
        f"run {name} exists with another spec: "
        + (f"it differs in {', '.join(changed)}" if changed else "it differs"),
        field=changed[0] if changed else None,
        fix="give the new spec another name to start a new run",
    )
