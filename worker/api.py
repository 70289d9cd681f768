"""The HTTP API, `/v1`: the door for programs (notebooks, CI pipelines, other services) and
people, with an identity from a token on every request.

    POST /v1/code                  a train.code folder (a tar) as a content-addressed snapshot
    POST /v1/runs                  submit a spec (owner = the caller; Idempotency-Key honoured)
    GET  /v1/runs                  every run, as `forgeline runs` shows them
    GET  /v1/runs/{name}           one run: phase, step, loss, attempts, placement, checkpoint
    GET  /v1/runs/{name}/metrics   its metric series (?key=train/loss …), from its MLflow run
    GET  /v1/runs/{name}/logs      its ranks' output (?attempt, node, rank; after= to follow)
    POST /v1/runs/{name}/cancel    one's own run, or anyone's as an operator
    POST /v1/runs/{name}/resume    a FAILED or CANCELLED one, from its last checkpoint
    POST /v1/runs/{name}/approve   as the caller, checked by the run's approval gate
    POST /v1/runs/{name}/reject
    GET  /v1/whoami                the caller's identity and roles

The API holds the Temporal connection; callers never need one. Every refusal is one JSON shape
(`{"error": {"code", "message", "field", "fix"}}`), and a spec is checked completely before
anything reaches Temporal. `forgeline api` serves it; `forgeline up` starts one.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from enum import StrEnum
from pathlib import Path
from typing import Annotated

from fastapi import FastAPI, Header, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from temporalio.client import Client
from temporalio.service import RPCError

from infra.identity import Identity
from infra.settings import Settings
from infra.tokens import TokenStore
from registry.approvals import ApprovalsFile, install_approvals, load_approvals
from registry.decision_key import DecisionKey
from registry.errors import ApprovalsInvalid
from trainer.rank_logs import pieces
from worker import cluster_actions, run_actions
from worker.api_code import (
    MAX_UPLOADS_AT_ONCE,
    UPLOAD_CAP,
    CodeRefused,
    check_code,
    publish_upload,
)
from worker.api_docs import add_docs
from worker.api_logs import BadCursor, LogQuery, read_logs
from worker.api_rules import (
    ApiError,
    Caller,
    checked_sources,
    checked_spec,
    refuse_another_team_s_model,
    require,
)
from worker.api_rules import error_response as _error
from worker.api_team_rights import (
    conflicting_spec,
    refuse_logs_of_another_team,
    refuse_what_the_team_may_not,
)
from worker.cli_common import CliError, get_client
from worker.fleet_metrics import exposition, twin_status
from worker.fleet_view import fleet_view
from worker.idempotency import MAX_KEY_CHARS, IdempotencyKeys
from worker.request_limits import Slots, limit_requests
from worker.runs import (
    ClusterLacks,
    RunNotFound,
    cluster_state,
    list_run_names,
    refuse_what_the_cluster_lacks,
    submit,
    submitted_spec,
    view,
)
from worker.source_check import SourceCheck
from worker.specfile import spec_sha256
from worker.team_sources import refuse_sources_outside_team
from workflows.contracts.api_models import (
    ApproveRequest,
    ErrorBody,
    ErrorDetail,
    FleetView,
    Lineage,
    LineageLink,
    MetricPoint,
    Metrics,
    RejectRequest,
    ResumeRequest,
    RunList,
    RunLogs,
    RunView,
    SubmitAnswer,
    SubmitRequest,
    WhoAmI,
)
from workflows.contracts.cluster_models import Admin, ClusterConfig, ClusterState, Node, NodeAdmin
from workflows.contracts.models import CodeRef, Decision
from workflows.contracts.names import InvalidName, check_name

API_VERSION = "v1"
CLUSTER_PAGE = Path(__file__).with_name("cluster_page.html")
# The page runs no script but its own and loads nothing from elsewhere; the token it is given
# stays in this origin's storage.
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; script-src 'unsafe-inline'; "
    "style-src 'unsafe-inline'; img-src 'self' data:",
    "Referrer-Policy": "no-referrer",
}


def make_app(
    settings: Settings, cluster_config: Callable[[], Awaitable[ClusterConfig]] | None = None
) -> FastAPI:
    """The API for `settings`; `cluster_config` reads the cluster file as applied (by default
    the Cluster workflow's, from Temporal; in-process tests give their own)."""
    keys = IdempotencyKeys(settings.home)
    check_sources = SourceCheck(settings)
    connection: dict[str, Client] = {}
    lock = asyncio.Lock()
    # Signs each decision as the person the token names: runs count no other (registry/).
    decision_key = DecisionKey(settings.open_store(), holder="the API")

    async def temporal() -> Client:
        # One connection for the process, made at the first request that needs it: the API
        # starts (and answers /v1/whoami) while Temporal is still coming up.
        async with lock:
            if "client" not in connection:
                try:
                    connection["client"] = await get_client(settings)
                except CliError as err:
                    raise ApiError(503, "unavailable", str(err)) from None
            return connection["client"]

    async def config_in_temporal() -> ClusterConfig:
        return (await cluster_state(await temporal())).config

    applied_config = cluster_config or config_in_temporal

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        yield
        connection.clear()
        check_sources.close()

    app = FastAPI(
        title="Forgeline",
        version=API_VERSION,
        description=__doc__.split("\n\n")[0],
        lifespan=lifespan,
        docs_url=None,  # their pages load scripts from a CDN: worker/api_docs.py instead
        redoc_url=None,
        responses={
            401: {"model": ErrorBody, "description": "no token, or not a valid one"},
            403: {"model": ErrorBody, "description": "the caller's roles do not allow it"},
            422: {"model": ErrorBody, "description": "bad input: the field and the fix"},
        },
    )

    app.state.tokens = TokenStore(settings.home)
    add_docs(app)
    limit_requests(app, app.state.tokens, {("POST", f"/{API_VERSION}/code"): UPLOAD_CAP})
    uploads = Slots(MAX_UPLOADS_AT_ONCE, "code uploads", retry_after_s=5)

    @app.exception_handler(ApiError)
    async def api_error(_: Request, err: ApiError) -> JSONResponse:
        return _error(err.status, err.detail, err.headers)

    @app.exception_handler(CodeRefused)
    async def code_refused(_: Request, err: CodeRefused) -> JSONResponse:
        return _error(err.status, ErrorDetail(code="invalid_code", message=str(err),
                                              field="code", fix=err.fix))  # fmt: skip

    @app.exception_handler(RequestValidationError)
    async def bad_request(_: Request, err: RequestValidationError) -> JSONResponse:
        first = err.errors()[0]
        where = ".".join(str(p) for p in first["loc"] if p not in ("body",))
        return _error(
            422,
            ErrorDetail(
                code="invalid_request",
                message=f"{where}: {first['msg']}",
                field=where or None,
                fix="see the schema at /openapi.json",
            ),
        )

    @app.exception_handler(RPCError)
    async def temporal_error(_: Request, err: RPCError) -> JSONResponse:
        # Temporal refused or could not be reached mid-request: nothing was half done that a
        # retry of the same request (with its Idempotency-Key) would not finish.
        fix = "retry the request; if it persists, check the control plane"
        return _error(503, ErrorDetail(code="unavailable", message=f"Temporal: {err.message[:300]}",
                                       fix=fix))  # fmt: skip

    @app.exception_handler(Exception)
    async def internal_error(_: Request, err: Exception) -> JSONResponse:
        # A bug: the one shape still, and the traceback in the API's log (uvicorn logs it).
        logging.getLogger("forgeline.api").exception("unhandled error")
        message = f"{type(err).__name__}: {str(err)[:300]}"
        fix = "a bug in Forgeline's API: the API's log has the traceback"
        return _error(500, ErrorDetail(code="internal", message=message, fix=fix))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, err: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(err.status_code, "http_error")
        return _error(err.status_code, ErrorDetail(code=code, message=str(err.detail)))

    async def run_view(name: str) -> RunView:
        try:
            check_name(name)
            found = await view(await temporal(), name)
        except InvalidName as err:
            raise ApiError(422, "invalid_name", str(err), field="name") from None
        except RunNotFound as err:
            raise ApiError(404, "not_found", str(err)) from None
        return found

    @app.post(
        f"/{API_VERSION}/code",
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {"application/x-tar": {"schema": {"type": "string",
                                                             "format": "binary"}}},
            }
        },
        responses={413: {"model": ErrorBody, "description": "more than a snapshot may hold"},
                   429: {"model": ErrorBody, "description": "uploads at their limit: Retry-After"}},
    )  # fmt: skip
    async def upload_code(request: Request, who: Caller) -> CodeRef:
        """A train.code folder as a tar of its files (what `forgeline run` and
        `Client.submit` send): published as a content-addressed snapshot; its answer goes into
        the submit's `code`."""
        require(who.may_submit_somewhere(), who, "upload code", "submit:TEAM")
        async with uploads.hold():
            data = await request.body()  # within UPLOAD_CAP: worker/request_limits.py
            return await asyncio.to_thread(publish_upload, settings.open_store(), data)

    async def owner_or_operator(name: str, who: Identity, verb: str) -> None:
        owner = (await run_view(name)).status.owner
        if not who.may_act_on_run_of(owner):
            raise ApiError(
                403,
                "forbidden",
                f"run {name} is {owner}'s: only they or an operator may {verb} it",
                fix="ask its owner, or an operator (role `operate`)",
            )

    @app.get(f"/{API_VERSION}/whoami")
    async def whoami(who: Caller) -> WhoAmI:
        return WhoAmI(person=who.person, roles=sorted(who.roles), token_id=who.token_id)

    @app.post(
        f"/{API_VERSION}/runs",
        responses={
            200: {"model": SubmitAnswer, "description": "the run existed with this spec"},
            201: {"model": SubmitAnswer, "description": "the run was started"},
            409: {"model": ErrorBody, "description": "a run or key exists with another spec"},
        },
    )
    async def submit_run(
        body: SubmitRequest,
        who: Caller,
        idempotency_key: Annotated[str | None, Header(max_length=MAX_KEY_CHARS)] = None,
    ) -> JSONResponse:
        spec = await checked_spec(body.spec, who, check_sources)
        await asyncio.to_thread(check_code, settings.open_store(), spec, body.code)
        # The team's sources before anything they name is listed: a listing says what exists
        # and goes to whatever endpoint= the spec names.
        queue = (await applied_config()).queue(spec.resources.team)
        await asyncio.to_thread(refuse_sources_outside_team, spec, queue)
        await checked_sources(spec, check_sources)
        client = await temporal()
        try:
            await refuse_what_the_cluster_lacks(client, spec)
        except ClusterLacks as err:
            raise ApiError(422, "invalid_spec", str(err), field=err.field) from None
        await refuse_what_the_team_may_not(client, settings, spec, who)
        await refuse_another_team_s_model(settings, spec)
        digest = spec_sha256(spec)
        if idempotency_key is not None:
            claim = await keys.claim(who.person, idempotency_key, spec.name, digest)
            if claim.run != spec.name:
                raise ApiError(
                    409,
                    "conflict",
                    f"Idempotency-Key {idempotency_key!r} was used for run {claim.run!r}; this "
                    f"request is for run {spec.name!r}",
                    field="name",
                    fix="use a new key for a new run",
                )
        _handle, started = await submit(client, spec, digest, body.code)
        current = await run_view(spec.name)
        if not started and current.status.spec_sha256 != digest:
            raise conflicting_spec(spec.name, await submitted_spec(client, spec.name), spec)
        answer = SubmitAnswer(created=started, run=current)
        return JSONResponse(answer.model_dump(mode="json"), status_code=201 if started else 200)

    async def run_views(names: list[str]) -> list[RunView]:
        found = await asyncio.gather(*(run_view(n) for n in names), return_exceptions=True)
        # A run deleted between the list and its query is simply no longer there.
        return sorted((v for v in found if isinstance(v, RunView)), key=lambda v: v.status.name)

    @app.get(f"/{API_VERSION}/runs")
    async def list_runs(who: Caller) -> RunList:
        return RunList(runs=await run_views(await list_run_names(await temporal())))

    @app.get(f"/{API_VERSION}/fleet")
    async def get_fleet(who: Caller) -> FleetView:
        """What the cluster page at / draws: nodes, queue, gangs and runs, with UI links."""
        client = await temporal()
        state = await cluster_state(client)
        runs = await run_views(await list_run_names(client))
        return fleet_view(state, runs, settings, datetime.now(UTC))

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def cluster_page() -> HTMLResponse:
        """The page holds no data: its script asks /v1/fleet with the reader's token."""
        return HTMLResponse(CLUSTER_PAGE.read_text(), headers=PAGE_HEADERS)

    @app.get(
        "/metrics",
        response_class=Response,
        responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}},
    )
    async def metrics(who: Caller) -> Response:
        """The fleet and its open runs in Prometheus' text format (worker/fleet_metrics.py);
        Prometheus scrapes it with a token, as any reader."""
        client = await temporal()
        state = await cluster_state(client)
        runs = await run_views(await list_run_names(client, open_only=True))
        twin = await asyncio.to_thread(twin_status, settings)
        body = exposition(state, runs, datetime.now(UTC), twin)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    @app.get(f"/{API_VERSION}/runs/{{name}}", responses={404: {"model": ErrorBody}})
    async def get_run(name: str, who: Caller) -> RunView:
        return await run_view(name)

    @app.get(f"/{API_VERSION}/runs/{{name}}/metrics", responses={404: {"model": ErrorBody}})
    async def get_metrics(
        name: str, who: Caller, key: Annotated[list[str] | None, Query()] = None
    ) -> Metrics:
        """The run's metric series from its MLflow run (train/loss, train/tokens_per_s, …; the
        keys asked for, or every one), as the ranks streamed them."""
        status = (await run_view(name)).status
        if status.mlflow_run_id is None:
            message = f"run {name} has no MLflow run yet: it has not started preparing its data"
            raise ApiError(404, "not_found", message, fix="ask again once it is PREPARING")
        from registry.tracking import metric_history  # MLflow: only for the requests that read it

        run_id = status.mlflow_run_id
        found = await asyncio.to_thread(metric_history, settings.mlflow_uri, run_id, key)
        series = {k: [MetricPoint(step=m.step, value=m.value, timestamp_ms=m.timestamp) for m in v]
                  for k, v in found.items()}  # fmt: skip
        return Metrics(run=name, mlflow_run_id=run_id, series=series)

    @app.get(f"/{API_VERSION}/runs/{{name}}/logs")
    async def get_logs(
        name: str,
        who: Caller,
        attempt: Annotated[int | None, Query(ge=1)] = None,
        node: str | None = None,
        rank: Annotated[int | None, Query(ge=0)] = None,
        after: Annotated[list[str] | None, Query()] = None,
    ) -> RunLogs:
        """The ranks' and torchrun's output as shipped to the store (the latest attempt unless
        one is asked for); `after=NODE/FILE:OFFSET` per file already read returns what is new.
        Only for the run's team, its owner and admins (403 naming the team otherwise)."""
        for field, value, what in (("name", name, "name"), ("node", node, "node id")):
            try:
                if value is not None:
                    check_name(value, what)
            except InvalidName as err:
                raise ApiError(422, "invalid_name", str(err), field=field) from None
        query = LogQuery(attempt, node, rank, tuple(after or ()))
        store = settings.open_store()
        found = await asyncio.to_thread(pieces, store, name)
        if found and not who.is_admin:
            # No logs, nothing to guard (which runs exist, every token sees: GET /v1/runs).
            await refuse_logs_of_another_team(await temporal(), name, who)
        try:
            return await asyncio.to_thread(read_logs, store, name, query, found)
        except BadCursor as err:
            raise ApiError(422, "invalid_cursor", str(err), field="after") from None

    @app.post(f"/{API_VERSION}/runs/{{name}}/cancel", responses={409: {"model": ErrorBody}})
    async def cancel_run(name: str, who: Caller, wait_s: float = 120.0) -> RunView:
        await owner_or_operator(name, who, "cancel")
        await _act(run_actions.cancel(await temporal(), name, wait_s))
        return await run_view(name)

    @app.post(f"/{API_VERSION}/runs/{{name}}/resume", responses={409: {"model": ErrorBody}})
    async def resume_run(name: str, who: Caller, body: ResumeRequest | None = None) -> RunView:
        """A FAILED or CANCELLED run trains on from its last committed checkpoint, with what it
        was submitted with and a fresh restart budget; `from_step` resumes any run that has
        ended from a checkpoint it keeps, `nodes` changes its size."""
        asked = body or ResumeRequest()
        await owner_or_operator(name, who, "resume")
        await _act(
            run_actions.resume(
                await temporal(), settings.open_store(), name, asked.from_step, asked.nodes
            )
        )
        return await run_view(name)

    async def decide(name: str, who: Identity, decision: Decision) -> RunView:
        status = (await run_view(name)).status
        if not who.may_approve(status.team, status.model_name):
            raise ApiError(
                403,
                "forbidden",
                f"{who.person} may not decide on the models of team {status.team!r} "
                f"({status.model_name})",
                fix=f"an admin can give the role approve:{status.team} or "
                f"approve:model:{status.model_name}",
            )
        await _act(run_actions.decide(await temporal(), name, decision, decision_key))
        return await run_view(name)

    @app.post(f"/{API_VERSION}/runs/{{name}}/approve", responses={409: {"model": ErrorBody}})
    async def approve_run(name: str, body: ApproveRequest, who: Caller) -> RunView:
        decision = Decision(
            approver=who.person, approve=True, reason=body.note, override_gate=body.override_gate
        )
        return await decide(name, who, decision)

    @app.post(f"/{API_VERSION}/runs/{{name}}/reject", responses={409: {"model": ErrorBody}})
    async def reject_run(name: str, body: RejectRequest, who: Caller) -> RunView:
        return await decide(name, who, Decision(approver=who.person, approve=False,
                                                reason=body.reason))  # fmt: skip

    @app.get(
        f"/{API_VERSION}/models/{{name}}/versions/{{version}}/lineage",
        responses={404: {"model": ErrorBody}},
    )
    async def get_lineage(name: str, version: str, who: Caller) -> Lineage:
        """`version` is a number or @ALIAS (`@production`)."""
        from worker.lineage import LineageError, check_version, trace

        try:
            check_name(name, "model name")
            check_version(version)
        except (InvalidName, CliError) as err:
            raise ApiError(422, "invalid_name", str(err), field="version") from None
        try:
            found = await asyncio.to_thread(trace, settings, settings.open_store(), name, version)
        except LineageError as err:
            raise ApiError(404, "not_found", str(err)) from None
        links = [LineageLink(what=k.what, detail=k.detail, check=k.check) for k in found]
        return Lineage(links=links, broken=any(k.broken for k in found))

    @app.get(f"/{API_VERSION}/cluster")
    async def get_cluster(who: Caller) -> ClusterState:
        """Nodes, queues, allocations and waiting gangs, as `forgeline nodes|queues|jobs`."""
        return await cluster_state(await temporal())

    @app.put(f"/{API_VERSION}/cluster/config")
    async def put_cluster_config(config: ClusterConfig, who: Caller) -> ClusterConfig:
        """Pods, the queue tree, spares, cost and grace, as `forgeline cluster apply`."""
        require(who.may_operate(), who, "change the cluster's configuration", "operate")
        return await cluster_actions.apply_config(await temporal(), config)

    @app.post(f"/{API_VERSION}/nodes/{{node_id}}/{{action}}", responses={404: {"model": ErrorBody}})
    async def node_action(node_id: str, action: NodeAction, who: Caller) -> Node:
        """drain (gangs checkpoint and move), cordon (no new work), undrain (back in service)."""
        require(who.may_operate(), who, f"{action.value} nodes", "operate")
        try:
            change = NodeAdmin(node_id=check_name(node_id, "node id"), admin=_ADMIN[action])
            return await cluster_actions.set_node_admin(await temporal(), change)
        except InvalidName as err:
            raise ApiError(422, "invalid_name", str(err), field="node_id") from None
        except cluster_actions.ClusterRefused as err:
            raise ApiError(404, "not_found", str(err), field="node_id") from None

    @app.get(f"/{API_VERSION}/approvals")
    async def get_approvals(who: Caller) -> ApprovalsFile:
        """The operators' approval rules (empty: anyone but the submitter may approve)."""
        try:
            rules = await asyncio.to_thread(load_approvals, settings.open_store(), settings.home)
            return rules or ApprovalsFile()
        except ApprovalsInvalid as err:
            raise ApiError(500, "invalid_rules", str(err)) from None

    @app.put(f"/{API_VERSION}/approvals")
    async def put_approvals(rules: ApprovalsFile, who: Caller) -> ApprovalsFile:
        """Replace the rules for runs that reach approval from now on (admins)."""
        require(who.is_admin, who, "change the approval rules", "admin")
        await asyncio.to_thread(install_approvals, settings.open_store(), rules, who.person)
        return rules

    return app


class NodeAction(StrEnum):
    drain = "drain"
    cordon = "cordon"
    undrain = "undrain"


_ADMIN = {
    NodeAction.drain: Admin.DRAINING,
    NodeAction.cordon: Admin.CORDONED,
    NodeAction.undrain: Admin.ACTIVE,
}


async def _act(action) -> None:
    try:
        await action
    except RunNotFound as err:
        raise ApiError(404, "not_found", str(err)) from None
    except run_actions.WrongPhase as err:
        raise ApiError(409, "wrong_phase", str(err)) from None
    except run_actions.DecisionRefused as err:
        raise ApiError(403, "refused", str(err)) from None
    except run_actions.StillStopping as err:
        raise ApiError(504, "timeout", str(err)) from None
    except run_actions.RunActionError as err:
        raise ApiError(422, "invalid_request", str(err)) from None
