"""One HTTP request to an ASGI app in the test's own event loop, with a body that streams in from
a generator and a count of the bytes the app took from it: what a server would have read off the
socket for the app. (No server, no client library: what the app reads is exactly what is counted.)
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterable, AsyncIterator, Iterable
from dataclasses import dataclass, field
from typing import Any

from starlette.types import ASGIApp, Message


@dataclass
class Answer:
    status: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    read: int = 0  # bytes of the request's body the app received

    def json(self) -> Any:
        return json.loads(self.body)


async def call(
    app: ASGIApp,
    method: str,
    path: str,
    headers: dict[str, str] | None = None,
    body: Iterable[bytes] | AsyncIterable[bytes] = (),
) -> Answer:
    """`body` may be async: a chunk it awaits holds the request there, as a slow client does."""
    answer = Answer()
    chunks = _chunks(body)
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()],
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 80),
    }

    async def receive() -> Message:
        chunk = await anext(chunks, None)
        if chunk is None:
            return {"type": "http.request", "body": b"", "more_body": False}
        answer.read += len(chunk)
        return {"type": "http.request", "body": chunk, "more_body": True}

    async def send(message: Message) -> None:
        if message["type"] == "http.response.start":
            answer.status = message["status"]
            answer.headers = {k.decode(): v.decode() for k, v in message.get("headers", [])}
        elif message["type"] == "http.response.body":
            answer.body += message.get("body", b"")

    await app(scope, receive, send)
    return answer


async def _chunks(body: Iterable[bytes] | AsyncIterable[bytes]) -> AsyncIterator[bytes]:
    if isinstance(body, AsyncIterable):
        async for chunk in body:
            yield chunk
    else:
        for chunk in body:
            yield chunk
