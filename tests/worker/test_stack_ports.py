import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from infra.errors import StackError
from infra.processes import ManagedProcess, free_port, free_ports
from worker.stack import _port, _port_of, _settles


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def test_requested_port_wins_and_must_be_free(busy_port: int) -> None:
    port = free_port()
    assert _port(port, None, busy_port) == port
    with pytest.raises(StackError, match=f"port {busy_port} is already in use"):
        _port(busy_port, None, port)


def test_recorded_port_is_reused_so_links_survive_down_and_up(busy_port: int) -> None:
    recorded, default = free_ports(2)
    assert _port(None, recorded, default) == recorded
    # Taken since: the conventional port, then any free one.
    assert _port(None, busy_port, default) == default
    chosen = _port(None, busy_port, busy_port)
    assert chosen not in (busy_port, None)


def test_port_of() -> None:
    assert _port_of("127.0.0.1:7233") == 7233
    assert _port_of("http://127.0.0.1:8233") == 8233
    assert _port_of("http://example.org/path") is None


def test_ports_chosen_together_are_distinct(busy_port: int) -> None:
    """One at a time, the OS handed CI the same free port twice (`--mlflow-port 33969
    --api-port 33969`): ports chosen together are held open together while chosen."""
    for _ in range(50):
        ports = free_ports(4)
        assert len(set(ports)) == 4, ports
    # The Temporal UI's port is chosen before Temporal listens on its own: never the same one.
    temporal = free_port()
    assert _port(None, temporal, temporal, temporal) != temporal
    assert _port(None, None, busy_port, temporal) not in (busy_port, temporal)
    with pytest.raises(StackError, match=f"port {temporal} is already in use"):
        _port(temporal, None, busy_port, temporal)


def test_a_server_on_its_way_down_is_waited_for_not_taken_for_running(tmp_path: Path) -> None:
    """`up` right after Temporal was stopped (an upgrade) found its process still alive, took it
    for running and failed to reach it (found by bench/soak.py): a server that runs without
    answering is waited for, and one that exits meanwhile is started again."""
    closed = free_port()
    exiting = ManagedProcess(tmp_path, "exiting")
    exiting.start([sys.executable, "-c", "import time; time.sleep(1)"])
    assert exiting.running()
    assert _settles(exiting, f"127.0.0.1:{closed}") is False  # it ended: start another

    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        port = listening.getsockname()[1]
        serving = ManagedProcess(tmp_path, "serving")
        serving.start([sys.executable, "-c", "import time; time.sleep(30)"])
        try:
            assert _settles(serving, f"127.0.0.1:{port}") is True  # it answers: running
        finally:
            serving.stop()
