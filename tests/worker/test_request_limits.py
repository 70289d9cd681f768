"""What the API holds of a request before it has decided anything (worker/request_limits.py),
asked of the app in-process with bodies that stream from generators: no token, no body read;
a body past its route's cap is refused as it arrives, whatever its Content-Length says."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from infra.processes import free_port
from infra.settings import Settings
from infra.tokens import TokenStore
from tests.asgi_call import Answer, call
from worker.api import make_app
from worker.api_code import MAX_UPLOAD_BYTES
from worker.request_limits import MAX_JSON_BYTES

MiB = 2**20
_CHUNK = b" " * MiB  # JSON's whitespace: a body that parses, were it ever read whole


def _mebibytes(n: int) -> Iterator[bytes]:
    for _ in range(n):
        yield _CHUNK


@pytest.fixture
def app_and_token(tmp_path: Path) -> tuple[object, str]:
    # Temporal's address is a free port nobody listens on: nothing here may need it.
    settings = Settings(home=tmp_path, temporal_address=f"127.0.0.1:{free_port()}")
    token, _ = TokenStore(tmp_path).create("alice", ["submit:research"], created_by="test")
    return make_app(settings), token


def _post(app, path: str, headers: dict[str, str], mebibytes: int) -> Answer:
    return asyncio.run(call(app, "POST", path, headers, _mebibytes(mebibytes)))


def test_a_body_without_a_valid_token_is_never_read(app_and_token) -> None:
    app, _ = app_and_token
    length = {"content-type": "application/json", "content-length": str(200 * MiB)}
    for headers in (length, {**length, "authorization": "Bearer flt_000000000000_" + "a" * 43}):
        answer = _post(app, "/v1/runs", headers, 200)
        assert answer.status == 401 and answer.json()["error"]["code"] == "unauthenticated"
        assert answer.read == 0
    # Without a Content-Length too (a chunked body), and on every route that takes a body.
    for method, path in (("POST", "/v1/code"), ("PUT", "/v1/approvals"), ("POST", "/v1/x")):
        answer = asyncio.run(call(app, method, path, {}, _mebibytes(200)))
        assert (answer.status, answer.read) == (401, 0), (method, path)


def test_a_body_over_its_cap_is_refused_as_it_streams_in(app_and_token) -> None:
    app, token = app_and_token
    auth = {"authorization": f"Bearer {token}", "content-type": "application/json"}
    # Declared: refused before a byte is read.
    answer = _post(app, "/v1/runs", {**auth, "content-length": str(200 * MiB)}, 200)
    assert (answer.status, answer.read) == (413, 0)
    error = answer.json()["error"]
    assert error["code"] == "too_large" and f"{MAX_JSON_BYTES // MiB} MiB" in error["message"]
    # No Content-Length, or one that lies: refused at the first chunk past the cap.
    for headers in (auth, {**auth, "content-length": "100"}):
        answer = _post(app, "/v1/runs", headers, 200)
        assert answer.status == 413 and answer.read == MAX_JSON_BYTES + MiB, headers
    # The code upload has its own cap, a snapshot's: 5 MiB is read (and is no tar).
    code = {"authorization": f"Bearer {token}", "content-type": "application/x-tar"}
    answer = _post(app, "/v1/code", code, 5)
    assert (answer.status, answer.read) == (422, 5 * MiB), answer.body
    answer = _post(app, "/v1/code", {**code, "content-length": str(MAX_UPLOAD_BYTES + 1)}, 200)
    assert (answer.status, answer.read) == (413, 0)
    assert f"{MAX_UPLOAD_BYTES // MiB} MiB" in answer.json()["error"]["message"]


def test_a_token_checked_before_the_body_still_decides_the_route(app_and_token) -> None:
    app, token = app_and_token
    reader, _ = TokenStore(app.state.tokens.path.parent).create("rhea", ["read"], created_by="t")
    answer = asyncio.run(call(app, "GET", "/v1/whoami", {"authorization": f"Bearer {token}"}))
    assert answer.status == 200 and answer.json()["person"] == "alice"
    headers = {"authorization": f"Bearer {reader}", "content-type": "application/x-tar"}
    answer = _post(app, "/v1/code", headers, 1)
    assert answer.status == 403 and answer.read == 0  # refused by role, its body unread
