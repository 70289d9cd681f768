import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from infra.errors import StackError
from infra.processes import (
    ManagedProcess,
    ephemeral_port_range,
    free_port,
    free_ports,
    port_is_open,
    started_at,
    wait_until,
)


def test_start_find_and_stop_a_process_group(tmp_path: Path) -> None:
    process = ManagedProcess(tmp_path, "sleeper")
    # The child forks a grandchild: stopping the group must take both.
    script = "import subprocess, time; subprocess.Popen(['sleep', '300']); time.sleep(300)"
    pid = process.start([sys.executable, "-c", script])
    assert process.pid() == pid
    assert process.stop(timeout=5)
    assert not process.running()
    time.sleep(0.2)
    # Exited children of this test process stay zombies until reaped; they hold nothing.
    alive = [p for p in Path("/proc").iterdir() if p.name.isdigit() and _group_member(p, pid)]
    assert alive == []


def test_a_server_that_exited_is_not_ready_though_its_port_answers(tmp_path: Path) -> None:
    """Its port is held by another process (here, this test's listener); the server itself
    failed at start-up: not ready, and the error carries its log."""
    server = ManagedProcess(tmp_path, "server")
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        script = "import sys; print('bind: address already in use'); sys.exit(1)"
        server.start([sys.executable, "-c", script])
        deadline = time.monotonic() + 30
        while server.running():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        with pytest.raises(StackError, match=r"exited during start-up:\n.*address already in use"):
            wait_until(lambda: port_is_open("127.0.0.1", port), 5, "server", server)


def test_a_recycled_pid_is_not_ours(tmp_path: Path) -> None:
    process = ManagedProcess(tmp_path, "ghost")
    process.pid_file.parent.mkdir(parents=True)
    # Our own pid with a start time that is not ours: never treated as the managed process.
    process.pid_file.write_text(f"{__import__('os').getpid()} 1\n")
    assert process.pid() is None
    assert not process.stop()


def test_free_port_is_free() -> None:
    assert not port_is_open("127.0.0.1", free_port())


def test_chosen_ports_are_distinct_and_never_ephemeral() -> None:
    # An ephemeral port may be handed to any process between our choice and our server's bind
    # (the Temporal dev server took a chosen UI port for one of its own services in CI).
    low, high = ephemeral_port_range()
    ports = free_ports(8)
    assert len(set(ports)) == 8
    assert all(not low <= port <= high for port in ports)


def _group_member(proc: Path, pgid: int) -> bool:
    try:
        fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return fields[0] != "Z" and int(fields[2]) == pgid


def test_a_process_start_time_is_when_it_began_not_when_asked() -> None:
    before = time.time()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        time.sleep(1.0)
        asked, began = time.time(), started_at(child.pid)
        # To the clock tick (10 ms), and long before it was asked.
        assert began is not None and before - 0.05 <= began < asked - 0.5, (before, began, asked)
    finally:
        child.kill()
        child.wait()
    assert started_at(child.pid) is None  # gone
