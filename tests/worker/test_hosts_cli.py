"""`forgeline agent | control | data worker` refuse to start, in one line, on a setting that
is missing or a service that does not answer; `up` starts no local server behind a setting
that points elsewhere; `forgeline logs` reads shipped rank logs back."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest

from infra.processes import free_port
from infra.store import LocalStore
from tests.e2e.conftest import FORGELINE
from tests.http_server import serving
from trainer.rank_logs import LogShipper
from worker.cli_common import ExitCode

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
    temporal, mlflow = free_port(), free_port()
    done = forgeline(
        tmp_path, "up", "--nodes", "1",
        FORGELINE_TEMPORAL_ADDRESS=f"127.0.0.1:{temporal}",
        FORGELINE_MLFLOW_URI=f"http://127.0.0.1:{mlflow}",
    )  # fmt: skip
    assert f"temporal      external at 127.0.0.1:{temporal}" in done.stdout, done.stdout
    assert f"MLflow at http://127.0.0.1:{mlflow}" in _one_error_line(done, DOWN, alone=False)
    assert not list((tmp_path / "run").glob("*.pid")), "a local server was started"


def test_logs_are_read_back_by_run_node_rank_and_attempt(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")  # the state folder's own store: FORGELINE_STORE unset
    for generation, node, rank in ((1, "h1", 0), (1, "h2", 1), (2, "h1", 0), (2, "h3", 1)):
        folder = tmp_path / "logs" / f"{generation}-{node}"
        folder.mkdir(parents=True)
        (folder / f"rank-{rank}.log").write_text(f"[rank {rank}/2 gen {generation}] on {node}\n")
        (folder / "torchrun.log").write_text(f"torchrun of {node}\n")
        LogShipper(store, "tiny", generation, node, folder).ship(final=True)

    latest = forgeline(tmp_path, "logs", "tiny")
    assert latest.returncode == 0, latest.stdout + latest.stderr
    assert "[rank 0/2 gen 2] on h1" in latest.stdout and "[rank 1/2 gen 2] on h3" in latest.stdout
    assert "gen 1]" not in latest.stdout and "torchrun of h3" in latest.stdout
    one = forgeline(tmp_path, "logs", "tiny", "--rank", "1", "--attempt", "1").stdout
    assert "[rank 1/2 gen 1] on h2" in one and "rank 0" not in one and "torchrun" not in one
    node = forgeline(tmp_path, "logs", "tiny", "--node", "h1", "--attempt", "1").stdout
    assert "on h1" in node and "h2" not in node
    assert "has no logs of attempt 7" in _one_error_line(
        forgeline(tmp_path, "logs", "tiny", "--attempt", "7"), NOT_FOUND
    )
    other = forgeline(tmp_path, "logs", "other")
    assert "no logs of run other" in _one_error_line(other, NOT_FOUND)


def test_logs_follow_prints_lines_as_they_are_shipped(tmp_path: Path) -> None:
    store, folder = LocalStore(tmp_path / "store"), tmp_path / "gen-1"
    folder.mkdir()
    log = folder / "rank-0.log"
    log.write_text("first line\n")
    shipper = LogShipper(store, "tiny", 1, "h1", folder)
    shipper.ship()
    clean = {k: v for k, v in os.environ.items() if not k.startswith("FORGELINE_")}
    follower = subprocess.Popen(
        [FORGELINE, "logs", "tiny", "--follow"], env={**clean, "FORGELINE_HOME": str(tmp_path)},
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert follower.stdout is not None
        assert "==> attempt (generation) 1, h1, rank-0 <==" in follower.stdout.readline()
        assert follower.stdout.readline() == "first line\n"
        with open(log, "a") as handle:
            handle.write("second line\n")
        shipper.ship()
        assert follower.stdout.readline() == "second line\n"  # within a poll, not at the end
    finally:
        follower.kill()
        follower.wait()
