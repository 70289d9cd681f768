"""Forgeline's HTTP API served by uvicorn over HTTP in a thread of the test process, for a state
folder with no stack behind it: what the API answers without Temporal (refusals, code uploads,
logs from the store) is tested against the real server and a real client."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import uvicorn

from infra.processes import free_port
from infra.settings import Settings
from worker.api import make_app


@contextlib.contextmanager
def serving_api(settings: Settings) -> Iterator[str]:
    """The API's URL while it serves `settings`; stopped on the way out."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(make_app(settings), port=port, log_level="critical"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the API did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
