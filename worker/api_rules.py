"""What the HTTP API checks before it acts, and how it says no: the caller's token, the
roles an action takes, a submitted spec (completely, owned by the caller), the model's team.
Every refusal is an `ApiError`, answered in the API's one error shape."""

from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import Depends, Header, Request
from fastapi.responses import JSONResponse

from infra.identity import Identity, InvalidIdentity, canonical_person
from infra.settings import Settings
from infra.tokens import TokenError, TokenStore
from worker.source_check import SourceCheck
from worker.specfile import SpecError, parse_spec
from workflows.contracts.api_models import ErrorBody, ErrorDetail
from workflows.contracts.spec import RunSpec

# Who to ask for a token, in every 401.
_ASK_FOR_A_TOKEN = "ask an admin for a token (`forgeline tokens create PERSON --role ...`)"
# Where a request's identity is kept once its token was checked (the request's scope state), so
# that a token checked before the body was read is not checked again (worker/request_limits.py).
IDENTITY = "forgeline.identity"


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        field: str | None = None,
        fix: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.headers = status, headers
        self.detail = ErrorDetail(code=code, message=message, field=field, fix=fix)


def error_response(
    status: int, detail: ErrorDetail, headers: dict[str, str] | None = None
) -> JSONResponse:
    return JSONResponse(ErrorBody(error=detail).model_dump(), status_code=status, headers=headers)


def authenticate(tokens: TokenStore, authorization: str | None) -> Identity:
    """The identity of a bearer token (the Authorization header's value); 401 without one that
    is valid now."""
    if not authorization or not authorization.lower().startswith("bearer "):
        raise ApiError(
            401,
            "unauthenticated",
            "no token: send the header `Authorization: Bearer <token>`",
            fix=_ASK_FOR_A_TOKEN,
        )
    try:
        return tokens.authenticate(authorization[len("bearer ") :])
    except TokenError as err:
        raise ApiError(401, "unauthenticated", str(err), fix=_ASK_FOR_A_TOKEN) from None


def caller(request: Request, authorization: Annotated[str | None, Header()] = None) -> Identity:
    """The identity of the request's bearer token; 401 without one that is valid now."""
    checked = request.scope.get("state", {}).get(IDENTITY)
    if isinstance(checked, Identity):
        return checked
    return authenticate(request.app.state.tokens, authorization)


# Module level, so that FastAPI resolves it in the handlers' (postponed) annotations.
Caller = Annotated[Identity, Depends(caller)]


def require(allowed: bool, who: Identity, what: str, role: str) -> None:
    if not allowed:
        raise ApiError(
            403,
            "forbidden",
            f"{who.person} may not {what}: it takes the role {role}",
            fix=f"ask an admin for the role {role}",
        )


async def checked_spec(data: dict, who: Identity, check_sources: SourceCheck) -> RunSpec:
    """The spec as the run will have it, checked whole but for what its sources name (its
    local sources inside the data roots as written: no file is looked at, see
    `checked_sources`) and owned by the caller; every refusal names the field."""
    owner = data.get("owner")
    if owner is not None:
        try:
            same = canonical_person(str(owner)) == who.person
        except InvalidIdentity:
            same = False
        if not same:
            raise ApiError(
                422,
                "invalid_spec",
                f"owner {owner!r}: a run's owner is whoever submits it (you are {who.person})",
                field="owner",
                fix="leave owner out of the spec",
            )
    try:
        spec = parse_spec({**data, "owner": who.person}, spec_dir=None)
        # Authorised before its files are looked for: nobody learns what exists where by
        # submitting to a team that is not theirs.
        if not who.may_submit(spec.resources.team):
            raise ApiError(
                403,
                "forbidden",
                f"{who.person} may not submit runs to team {spec.resources.team!r}",
                field="resources.team",
                fix=f"use a team you submit to, or ask an admin for submit:{spec.resources.team}",
            )
        check_sources.within_roots(spec)
    except SpecError as err:
        raise _invalid_spec(err) from None
    return spec


async def checked_sources(spec: RunSpec, check_sources: SourceCheck) -> None:
    """What the spec's sources name exists, as `forgeline run` checks a file's: listed only
    once the team may read them (worker.team_sources), since a listing answers what exists
    and goes where an `endpoint=` says."""
    try:
        await check_sources(spec)
    except SpecError as err:
        raise _invalid_spec(err) from None


def _invalid_spec(err: SpecError) -> ApiError:
    message = str(err).removeprefix("invalid run spec:\n").strip()
    field = message.split(":", 1)[0].strip() if ":" in message else None
    return ApiError(422, "invalid_spec", message, field=field, fix=None)


async def refuse_another_team_s_model(settings: Settings, spec: RunSpec) -> None:
    """A run may register only its team's models: found now rather than when it registers,
    hours of GPUs later. (Registration checks again, and decides: a model registered by
    another team in between still refuses the run's version.)"""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    from registry.tracking import model_team

    client = MlflowClient(tracking_uri=settings.mlflow_uri)
    try:
        # MLflow's client retries an unreachable server for minutes: a submit does not wait.
        found = asyncio.to_thread(model_team, client, spec.model_name)
        owner = await asyncio.wait_for(found, timeout=10)
    except (MlflowException, TimeoutError):
        return  # MLflow unreachable: the registration's check still holds
    if owner is not None and owner != spec.resources.team:
        raise ApiError(
            403,
            "forbidden",
            f"model {spec.model_name!r} belongs to team {owner!r}, which registered it first",
            field="registry.model_name",
            fix="name a model of your team's (registry.model_name), or a new one",
        )
