"""`forgeline agent | control | data worker` refuse to start, in one line, on a setting that
is missing or a service that does not answer; `up` starts no local server behind a setting
that points elsewhere."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest

from infra.processes import free_port, free_ports
from tests.e2e.conftest import FORGELINE
from tests.http_server import serving
from worker.cli_common import CliError, ExitCode, parse_topology

BAD_INPUT, DOWN, NOT_FOUND = ExitCode.BAD_INPUT, ExitCode.DOWN, ExitCode.NOT_FOUND


def forgeline(home: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("FORGELINE_")}
    return subprocess.run(
        [FORGELINE, *args], env={**clean, "FORGELINE_HOME": str(home), **env},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip


class _Health(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def healthy_mlflow() -> Iterator[str]:
    """Something that answers MLflow's health check, as a real server does."""
    with serving(_Health) as url:
        yield url


def _one_error_line(done: subprocess.CompletedProcess, code: ExitCode, alone: bool = True) -> str:
    """The command's one error line (and, `alone`, nothing else), with no traceback, and the
    exit code of its kind."""
    assert done.returncode == code, done.stdout + done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    (error,) = [line for line in lines if line.startswith("error: ")]
    assert not alone or lines == [error], done.stdout
    return error


def test_an_agent_without_its_settings_names_each_one(tmp_path: Path) -> None:
    line = _one_error_line(forgeline(tmp_path, "agent", "--node-id", "gpu-7"), BAD_INPUT)
    for variable in ("FORGELINE_TEMPORAL_ADDRESS", "FORGELINE_STORE", "FORGELINE_MLFLOW_URI"):
        assert variable in line, line
    # A data worker needs no MLflow, and says only what it misses.
    done = forgeline(tmp_path, "data", "worker", "--store", str(tmp_path / "s"))
    line = _one_error_line(done, BAD_INPUT)
    assert "FORGELINE_TEMPORAL_ADDRESS" in line and "MLFLOW" not in line, line


def test_an_agent_whose_mlflow_does_not_answer_refuses_to_start(tmp_path: Path) -> None:
    closed = free_port()
    line = _one_error_line(forgeline(
        tmp_path, "agent", "--node-id", "gpu-7", "--temporal-address", f"127.0.0.1:{free_port()}",
        "--store", str(tmp_path / "store"), "--mlflow-uri", f"http://127.0.0.1:{closed}",
    ), DOWN)  # fmt: skip
    assert f"MLflow at http://127.0.0.1:{closed} does not answer" in line, line
    assert "FORGELINE_MLFLOW_URI" in line


def test_a_control_worker_whose_temporal_does_not_answer_refuses_to_start(
    tmp_path: Path, healthy_mlflow: str
) -> None:
    closed = free_port()
    line = _one_error_line(forgeline(
        tmp_path, "control", "--store", str(tmp_path / "store"), "--mlflow-uri", healthy_mlflow,
        FORGELINE_TEMPORAL_ADDRESS=f"127.0.0.1:{closed}",
    ), DOWN)  # fmt: skip
    assert f"cannot reach Temporal at 127.0.0.1:{closed}" in line, line
    assert "FORGELINE_TEMPORAL_ADDRESS" in line and "forgeline up" not in line, line


def test_up_starts_no_local_server_behind_settings_that_point_elsewhere(tmp_path: Path) -> None:
    temporal, mlflow = free_ports(2)
    done = forgeline(
        tmp_path, "up", "--nodes", "1",
        FORGELINE_TEMPORAL_ADDRESS=f"127.0.0.1:{temporal}",
        FORGELINE_MLFLOW_URI=f"http://127.0.0.1:{mlflow}",
    )  # fmt: skip
    assert f"temporal      external at 127.0.0.1:{temporal}" in done.stdout, done.stdout
    assert f"MLflow at http://127.0.0.1:{mlflow}" in _one_error_line(done, DOWN, alone=False)
    assert not list((tmp_path / "run").glob("*.pid")), "a local server was started"


def test_an_agent_s_topology_is_level_equals_unit() -> None:
    # In-process: the agent parses --topology first, and CliError is its one line (the
    # settings tests above show that path through a real `forgeline agent`).
    with pytest.raises(CliError, match="'rack' is not LEVEL=UNIT: write it as block=b1,rack=r3"):
        parse_topology("block=b1,rack")
    with pytest.raises(CliError, match="level 'rack' is given twice"):
        parse_topology("rack=a,rack=b")
    with pytest.raises(CliError, match="rack name"):
        parse_topology("rack=R/3")
    assert parse_topology(" block=b1, rack=r3 ") == {"block": "b1", "rack": "r3"}
    assert parse_topology("") == {}
