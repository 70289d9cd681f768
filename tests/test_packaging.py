"""Forgeline as a wheel: what a host without the repository installs. Every module of the
design's folders is in it, and (slow) the CLI runs from it in a clean virtual environment."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.fresh_env import PIP_TIMEOUT_S, without_pythonpath

PACKAGES = ("forgeline", "infra", "workflows", "activities", "dataprep", "trainer", "registry",
            "worker")  # fmt: skip


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


def test_the_wheel_holds_every_module_of_the_design_s_folders(tmp_path: Path) -> None:
    wheel = build_wheel(tmp_path)
    shipped = set(zipfile.ZipFile(wheel).namelist())
    tree = {
        str(path.relative_to(REPO))
        for package in PACKAGES
        for path in (REPO / package).rglob("*.py")
        if "__pycache__" not in path.parts
    }
    assert "workflows/fleet/engine.py" in tree
    assert sorted(tree - shipped) == []
    assert not [name for name in shipped if name.startswith("tests/")]


@pytest.mark.slow
@pytest.mark.timeout(PIP_TIMEOUT_S * 2 + 300)
def test_the_cli_runs_from_the_wheel_in_a_clean_environment(tmp_path: Path) -> None:
    """Installed as a host would install it (torch first, the CPU wheel on disk), run from a
    folder that is not the repository: every module imports, and the CLI starts."""
    from tests.fresh_env import fresh_python

    wheel = build_wheel(tmp_path)
    requirements = tmp_path / "requirements.txt"
    requirements.write_text(f"{wheel}\n")
    python = fresh_python(str(requirements), tmp_path / "env")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    every_module = (
        "import importlib, pkgutil\n"
        f"for top in {PACKAGES!r}:\n"
        "    package = importlib.import_module(top)\n"
        "    assert 'site-packages' in package.__file__, package.__file__\n"
        "    for found in pkgutil.walk_packages(package.__path__, top + '.'):\n"
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
