"""`forgeline chaos corrupt-grad` and `flip-bit` leave their order in the job folders of the
ranks running on a node, or of one run's ranks only (`--run`): a node with several GPUs holds
several runs' jobs, and an order aimed at one run must not change another's weights."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from trainer.job import CHAOS_FILE
from trainer.torchrun_process import RANK_SCRIPT
from worker.cli import app, outcome

RUNNER = CliRunner()


@pytest.fixture
def home(tmp_path: Path) -> Iterator[Path]:
    """A state folder whose node n0 runs one rank of run `a` and one of run `b`: real processes
    with a rank's command line (the job file and the rank script), as torchrun starts them."""
    home = tmp_path / "home"
    ranks = []
    for run in ("a", "b"):
        folder = home / "nodes" / "n0" / "runs" / run / "gen-1"
        folder.mkdir(parents=True)
        argv = [sys.executable, "-c", "import time; time.sleep(120)", RANK_SCRIPT,
                str(folder / "job.json")]  # fmt: skip
        ranks.append(subprocess.Popen(argv))
    yield home
    for rank in ranks:
        rank.kill()
        rank.wait()


def chaos(home: Path, *args: str) -> str:
    """What `forgeline chaos ARGS` shows: its output, or the error its main() prints."""
    result = RUNNER.invoke(app, ["chaos", *args], env={"FORGELINE_HOME": str(home)})
    shown = outcome(result.exception) if result.exception else None
    return shown[0] if shown else result.output


def order_of(home: Path, run: str) -> str | None:
    path = home / "nodes" / "n0" / "runs" / run / "gen-1" / CHAOS_FILE
    return path.read_text() if path.exists() else None


def test_an_order_with_run_reaches_that_run_s_ranks_only(home: Path) -> None:
    shown = chaos(home, "corrupt-grad", "n0", "--finite", "--scale", "1.5", "--at-step", "30",
                  "--run", "b")  # fmt: skip
    assert "(1 job(s))" in shown, shown
    assert order_of(home, "a") is None
    assert order_of(home, "b") == "corrupt-grad 30 1.5\n"

    shown = chaos(home, "flip-bit", "n0", "--at-step", "7")
    assert "(2 job(s))" in shown, shown
    assert order_of(home, "a") == order_of(home, "b") == "flip-bit 7\n"


def test_an_order_for_a_run_the_node_does_not_hold_is_refused(home: Path) -> None:
    shown = chaos(home, "corrupt-grad", "n0", "--run", "c")
    assert "node n0 runs no training ranks of run c now" in shown, shown
    assert order_of(home, "a") is None and order_of(home, "b") is None
    shown = chaos(home, "flip-bit", "n0", "--run", "../a")
    assert "run name" in shown and order_of(home, "a") is None, shown
