"""One real Temporal dev server for the workflow tests of a session, on free ports."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from infra.local_servers import temporal_dev_server_argv
from infra.processes import ManagedProcess, free_port, port_is_open, wait_until
from tests.s3_server import bucket, endpoint, raw
from workflows.search_attributes import SEARCH_ATTRIBUTE_TYPES

__all__ = ["bucket", "endpoint", "raw", "task_queue", "temporal_address"]  # S3: moto over HTTP

CONTINUE_AS_NEW_AFTER = 300  # events


@pytest.fixture(scope="session")
def temporal_address(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    home = tmp_path_factory.mktemp("temporal")
    port = free_port()
    server = ManagedProcess(home, "temporal")
    # A low threshold makes the server suggest continue-as-new after a few hundred events, so
    # the Cluster workflow's continue-as-new is exercised by an ordinary test.
    argv = temporal_dev_server_argv(
        home / "temporal.db",
        port,
        0,
        headless=True,
        dynamic_config={"limit.historyCount.suggestContinueAsNew": CONTINUE_AS_NEW_AFTER},
        search_attributes=SEARCH_ATTRIBUTE_TYPES,
    )
    server.start(argv)
    try:
        wait_until(lambda: port_is_open("127.0.0.1", port), 60, "Temporal dev server", server)
        yield f"127.0.0.1:{port}"
    finally:
        server.stop()


@pytest.fixture
def task_queue() -> str:
    """A fresh task queue per test, so no test's worker picks up another's tasks."""
    return f"test-{uuid.uuid4().hex[:12]}"
