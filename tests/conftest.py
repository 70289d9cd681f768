"""Shared fixtures: the repository's paths, a small corpus, and one Temporal dev server for the
tests of a session that need one (the workflows', and the API's that ask Temporal whose a run
is)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
from temporalio.client import Client
from xdist.scheduler import LoadScopeScheduling

from infra.local_servers import temporal_dev_server_argv
from infra.processes import ManagedProcess, free_port, port_is_open, wait_until
from workflows.search_attributes import SEARCH_ATTRIBUTE_TYPES

CONTINUE_AS_NEW_AFTER = 300  # events
# `make test` and CI run the tests on two workers (pytest-xdist): a file's tests stay together
# (its module fixtures are made once), and the files below, which share something of this
# machine's beyond their own folders, stay on one worker together (_ByFileOrShared).
ONE_WORKER = {
    # podman's image store: the test image is built once per machine, under one name.
    "podman": ("tests/e2e/test_image.py", "tests/infra/test_containers.py",
               "tests/security/test_hostile_script.py", "tests/worker/test_image_submission.py",
               "tests/activities/test_node_images.py"),
    "network-namespaces": ("tests/hosts/",),  # a bridge and hosts in 198.18.0.0/15
}  # fmt: skip
REPO = Path(__file__).resolve().parent.parent
SHAKESPEARE = REPO / "examples" / "data" / "tinyshakespeare.txt"


class _ByFileOrShared(LoadScopeScheduling):
    """A file's tests go to one worker together, as do the files of a group in ONE_WORKER.
    (xdist's `loadgroup` marks do not work with pytest 9: xdist tags a test's old `_nodeid`,
    which pytest no longer reads, and every test went its own way.)"""

    def _split_scope(self, nodeid: str) -> str:
        path = nodeid.split("::", 1)[0]
        return next((g for g, files in ONE_WORKER.items() if path.startswith(files)), path)


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # optional: pytest -p no:xdist runs too
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> LoadScopeScheduling:
    return _ByFileOrShared(config, log)


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    """The first ~200 KB of tinyshakespeare plus two exact duplicates (one reformatted)."""
    text = SHAKESPEARE.read_text()[:200_000]
    speech = "First Citizen:\nBefore we proceed any further, hear me speak."
    path = tmp_path / "corpus.txt"
    reformatted = "  first citizen:\n  BEFORE we proceed any further,  hear me speak."
    path.write_text(f"{text}\n\n{speech}\n\n{reformatted}\n")
    return path


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
        # Its frontend answers, not just its port: a client that connected the moment the port
        # opened was told "Frontend is not healthy yet" (the first test of a slow run).
        wait_until(lambda: _answers(f"127.0.0.1:{port}"), 60, "Temporal dev server", server)
        yield f"127.0.0.1:{port}"
    finally:
        server.stop()


def _answers(address: str) -> bool:
    """The dev server at `address` accepts a client (its port open and its frontend healthy)."""
    host, port = address.rsplit(":", 1)
    if not port_is_open(host, int(port)):
        return False
    try:
        asyncio.run(Client.connect(address))
    except RuntimeError:  # "Failed client connect: ... Frontend is not healthy yet"
        return False
    return True
