"""`forgeline --version` says which Forgeline answers, and nothing else; the shell completes
its commands."""

from __future__ import annotations

import tomllib

from typer.testing import CliRunner

from tests.conftest import REPO
from worker.cli import app


def test_the_version_is_the_project_s() -> None:
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    shown = CliRunner().invoke(app, ["--version"])
    assert shown.exit_code == 0 and shown.output == f"forgeline {version}\n", shown.output


def test_the_shell_completes_commands_and_options() -> None:
    """What bash's completion (`forgeline --install-completion`) asks the CLI, answered."""
    runner = CliRunner()

    def complete(words: str) -> list[str]:
        env = {"_FORGELINE_COMPLETE": "complete_bash", "COMP_WORDS": words,
               "COMP_CWORD": str(len(words.split()) - 1)}  # fmt: skip
        done = runner.invoke(app, [], env=env, prog_name="forgeline")
        return done.output.split()

    assert complete("forgeline appr") == ["approve", "approvals"]
    assert "--override-gate" in complete("forgeline approve tiny --")
    assert "--install-completion" in CliRunner().invoke(app, ["--help"]).output
