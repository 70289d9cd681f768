"""The real local stack, driven through the `forgeline` CLI as a person would."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from infra.processes import free_port
from infra.settings import load_settings
from worker.chaos import trainer_processes

FORGELINE = str(Path(sys.executable).parent / "forgeline")


@dataclass
class Stack:
    home: Path
    env: dict[str, str]

    def cli(
        self, *args: str, timeout: float = 300, check: bool = True
    ) -> subprocess.CompletedProcess:
        result = subprocess.run(
            [FORGELINE, *args], env=self.env, capture_output=True, text=True, timeout=timeout
        )
        if check and result.returncode != 0:
            raise AssertionError(
                f"forgeline {' '.join(args)} exited {result.returncode}\n"
                f"stdout:\n{result.stdout}\nstderr:\n{result.stderr[-3000:]}"
            )
        return result

    @property
    def settings(self):
        return load_settings(self.home)


def ranks_of(home: Path, run: str) -> list[int]:
    """Pids of trainer rank or torchrun processes working on `run` under this stack's home."""
    return trainer_processes(home, run=run)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    home = tmp_path_factory.mktemp("forgeline-home")
    env = {**os.environ, "FORGELINE_HOME": str(home)}
    for name in list(env):
        if name.startswith("FORGELINE_") and name != "FORGELINE_HOME":
            del env[name]
    s = Stack(home, env)
    ports = [
        "--temporal-port",
        str(free_port()),
        "--ui-port",
        str(free_port()),
        "--mlflow-port",
        str(free_port()),
    ]
    try:
        s.cli("up", "--nodes", "3", "--gpus-per-node", "1", *ports, timeout=240)
        yield s
    finally:
        s.cli("down", timeout=120, check=False)
        leftovers = [p for p in (home / "run").glob("*.pid")]
        assert leftovers == [], f"`forgeline down` left pid files: {leftovers}"
