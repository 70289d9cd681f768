"""`forgeline --version` says which Forgeline answers, and nothing else."""

from __future__ import annotations

import tomllib

from typer.testing import CliRunner

from tests.conftest import REPO
from worker.cli import app


def test_the_version_is_the_project_s() -> None:
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    shown = CliRunner().invoke(app, ["--version"])
    assert shown.exit_code == 0 and shown.output == f"forgeline {version}\n", shown.output
