"""What the HTTP API holds of a request before it has decided anything: a request that may carry
a body is authenticated from its headers before a byte of the body is read, every body is
counted against its route's cap as it streams in, and a costly kind of request (a code upload)
is taken only so many at a time.

Without this, FastAPI reads and parses a JSON body before the handler's dependencies check the
token: 200 MiB from nobody cost 600 MiB of memory before the 401. Now a POST, PUT, PATCH or
DELETE without a valid token is answered 401 with its body unread, and a body over its cap is
answered 413 naming the cap: at once when its Content-Length says so, else at the first chunk
past the cap (a body sent without a Content-Length, or longer than the one it declares, is
counted all the same).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from infra.tokens import TokenStore
from worker.api_rules import IDENTITY, ApiError, authenticate, error_response
from workflows.contracts.api_models import ErrorDetail

# A spec, a cluster configuration or the approval rules: kilobytes. A few MiB leaves room for
# the largest of them and holds back anything that is not one.
MAX_JSON_BYTES = 4 * 2**20
# The methods whose requests carry a body: none is read before its token is checked.
_WITH_BODY = frozenset({"POST", "PUT", "PATCH", "DELETE"})


@dataclass(frozen=True)
class BodyCap:
    """The most a route's request body may hold, and what to do instead of sending more."""

    limit: int
    fix: str

    def detail(self) -> ErrorDetail:
        return ErrorDetail(
            code="too_large",
            message=f"the request's body is over {_size(self.limit)}, the most this request takes",
            fix=self.fix,
        )


JSON_CAP = BodyCap(MAX_JSON_BYTES, "send the JSON the schema at /openapi.json describes")


class BodyTooLarge(HTTPException):
    """Raised from the body's stream inside the app. An HTTPException, so that FastAPI passes it
    through its body parsing (which answers any other error as a 400) to the API's handler."""

    def __init__(self, cap: BodyCap) -> None:
        super().__init__(413, cap.detail().message)
        self.cap = cap


def _size(limit: int) -> str:
    return f"{limit / 2**20:g} MiB" if limit >= 2**20 else f"{limit} bytes"


def limit_requests(
    app: FastAPI, tokens: TokenStore, caps: Mapping[tuple[str, str], BodyCap]
) -> None:
    """Authenticate before reading a body and cap every body: `caps` by (method, path), every
    other route `JSON_CAP`."""
    app.add_middleware(RequestLimits, tokens=tokens, caps=caps)

    @app.exception_handler(BodyTooLarge)
    async def too_large(_: Request, err: BodyTooLarge) -> JSONResponse:
        return error_response(413, err.cap.detail())


class RequestLimits:
    """ASGI middleware: the token before the body, and each body within its cap."""

    def __init__(
        self, app: ASGIApp, tokens: TokenStore, caps: Mapping[tuple[str, str], BodyCap]
    ) -> None:
        self.app, self.tokens, self.caps = app, tokens, caps

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = Headers(scope=scope)
        if scope["method"] in _WITH_BODY:
            try:
                # A thread: the token store is a file.
                header = headers.get("authorization")
                who = await asyncio.to_thread(authenticate, self.tokens, header)
            except ApiError as err:
                return await error_response(err.status, err.detail)(scope, receive, send)
            scope.setdefault("state", {})[IDENTITY] = who
        cap = self.caps.get((scope["method"], scope["path"]), JSON_CAP)
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > cap.limit:
            return await error_response(413, cap.detail())(scope, receive, send)
        await self.app(scope, _counted(receive, cap), send)


def _counted(receive: Receive, cap: BodyCap) -> Receive:
    """`receive`, refusing the body at the first chunk that takes it past the cap."""
    seen = 0

    async def counted() -> Message:
        nonlocal seen
        message = await receive()
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > cap.limit:
                raise BodyTooLarge(cap)
        return message

    return counted


class Slots:
    """At most `size` requests of one kind at a time in this API process: the next is refused
    at once (429, with Retry-After) rather than queued, so that what the waiting ones would hold
    (their bodies, their threads) is never held."""

    def __init__(self, size: int, what: str, retry_after_s: int) -> None:
        self.size, self.what, self.retry_after_s = size, what, retry_after_s
        self.taken = 0  # one event loop: no await between the test and the take

    @contextlib.asynccontextmanager
    async def hold(self) -> AsyncIterator[None]:
        if self.taken >= self.size:
            raise ApiError(
                429,
                "busy",
                f"{self.size} {self.what} are in progress, the most this API takes at once",
                fix=f"send it again in {self.retry_after_s} s",
                headers={"Retry-After": str(self.retry_after_s)},
            )
        self.taken += 1
        try:
            yield
        finally:
            self.taken -= 1
