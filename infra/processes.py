"""Start, find and stop the long-lived processes of the local stack.

Each process runs in its own session (process group), so stopping it also stops whatever it
forked (MLflow's workers, torchrun's ranks). A pid file records the pid together with the
process's start time, so a recycled pid is never mistaken for ours and never signalled.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from infra.errors import StackError


def free_port() -> int:
    """A TCP port that the OS reports free on loopback right now."""
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """`count` distinct TCP ports free on loopback right now, drawn from below the kernel's
    ephemeral range. A port the OS hands out for `bind(0)` is an ephemeral one, and any process
    may be handed it next for an outgoing connection or a listener of its own: in CI the
    Temporal dev server took the UI port chosen for it for one of its internal services and
    failed to start (`listen tcp 127.0.0.1:45771: bind: address already in use`). Ports below
    the range are only ever taken by someone who asks for them by number. They are held open
    together while chosen, so the same port is never handed out twice in one call."""
    low, high = ephemeral_port_range()
    # Below the range, and above it where a host set the range low.
    candidates = [*range(_LOWEST_CHOSEN_PORT, low), *range(high + 1, 65536)]
    random.SystemRandom().shuffle(candidates)
    with contextlib.ExitStack() as held:
        chosen: list[int] = []
        for port in candidates:
            sock = held.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue  # taken (or in TIME_WAIT): the next candidate
            chosen.append(port)
            if len(chosen) == count:
                return chosen
    raise StackError(
        f"no {count} free TCP ports from {_LOWEST_CHOSEN_PORT} outside the ephemeral range "
        f"{low}-{high}: stop servers you no longer need or narrow net.ipv4.ip_local_port_range"
    )


# Above the conventional ports of the stack's own servers (7233, 8080, 5000, 8000) and of most
# services a host runs; the range up to the ephemeral ports is left to tests and benchmarks.
_LOWEST_CHOSEN_PORT = 20000


def ephemeral_port_range() -> tuple[int, int]:
    """The kernel's range for ports handed out by number 0 (Linux's default where unreadable)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def port_is_open(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((host, port)) == 0


def _start_time(pid: int) -> str | None:
    """The kernel's start time of `pid` (field 22 of /proc/PID/stat), or None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may contain spaces; everything after the last ')' is fixed.
    fields = stat.rsplit(")", 1)[1].split()
    if fields[0] == "Z":  # a zombie has exited; it only waits to be reaped
        return None
    return fields[19]


def started_at(pid: int) -> float | None:
    """When `pid` started, in epoch seconds (to the kernel's clock tick, 10 ms), or None if it
    is gone or this is not Linux: now, less the time since boot, plus the process's start in
    ticks since boot (the boot time /proc/stat gives is whole seconds)."""
    ticks = _start_time(pid)
    try:
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    if ticks is None:
        return None
    return time.time() - uptime + int(ticks) / os.sysconf("SC_CLK_TCK")


class ManagedProcess:
    """A named background process with its pid file and log under the state folder."""

    def __init__(self, home: Path, name: str) -> None:
        self.name = name
        self.pid_file = home / "run" / f"{name}.pid"
        self.log_file = home / "logs" / f"{name}.log"

    def pid(self) -> int | None:
        """The pid if the process we started is still running, else None."""
        try:
            pid_text, started = self.pid_file.read_text().split()
        except (OSError, ValueError):
            return None
        pid = int(pid_text)
        return pid if _start_time(pid) == started else None

    def running(self) -> bool:
        return self.pid() is not None

    def start(
        self,
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
        inherit_env: bool = True,
    ) -> int:
        """Start `argv` in a session of its own. Its environment is this process's with `env`
        over it, or (`inherit_env=False`) exactly `env`: for code that must hold none of the
        caller's secrets."""
        self.pid_file.parent.mkdir(parents=True, exist_ok=True)
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_file, "ab") as log:
            proc = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**(os.environ if inherit_env else {}), **(env or {})},
                cwd=cwd,
                start_new_session=True,
            )
        started = _start_time(proc.pid)
        self.pid_file.write_text(f"{proc.pid} {started}\n")
        return proc.pid

    def stop(self, timeout: float = 10.0) -> bool:
        """SIGTERM the process group, SIGKILL it after `timeout`; True if something was stopped."""
        pid = self.pid()
        if pid is None:
            self.pid_file.unlink(missing_ok=True)
            return False
        _signal_group(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.pid() is not None:
            time.sleep(0.1)
        if self.pid() is not None:
            _signal_group(pid, signal.SIGKILL)
        self.pid_file.unlink(missing_ok=True)
        return True

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def _signal_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def wait_until(
    ready: Callable[[], bool], timeout: float, what: str, process: ManagedProcess | None = None
) -> None:
    """Poll `ready` until it holds; fail with the process's log tail if it died or timed out.
    Ready only while the process runs: a server that exits at start-up (its port taken by then,
    a bad database) leaves its port answering whenever another process holds it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = process is None or process.running()
        if ready() and alive:
            return
        if not alive:
            assert process is not None
            raise StackError(f"{what} exited during start-up:\n{process.log_tail()}")
        time.sleep(0.2)
    tail = process.log_tail() if process else ""
    raise StackError(f"{what} was not ready after {timeout:.0f} s\n{tail}")


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as response:
            return 200 <= response.status < 300
    except OSError:
        return False
