"""infra/deploy/slurm and infra/deploy/systemd: the agent as Slurm and systemd start it. The
sbatch script runs here with a stand-in srun (one node: this one) and a stand-in forgeline that
prints what it was given; the unit goes through `systemd-analyze verify`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.forgeline_argv import check_forgeline_argv

DEPLOY = REPO / "infra" / "deploy"
SBATCH = DEPLOY / "slurm" / "forgeline-agents.sbatch"
UNIT = DEPLOY / "systemd" / "forgeline-agent.service"
API_UNIT = DEPLOY / "systemd" / "forgeline-api.service"

# srun's stand-in: the step's task on one node, its options ignored.
FAKE_SRUN = """#!/bin/bash
while [[ "$1" == -* ]]; do shift; done
exec "$@"
"""
# forgeline's stand-in: its arguments and the environment the agent would start with.
FAKE_FORGELINE = """#!/usr/bin/env python3
import json, os, sys
keep = ("FORGELINE_HOME", "FORGELINE_TEMPORAL_ADDRESS", "NCCL_IB_HCA")
print(json.dumps({"argv": sys.argv[1:], "env": {k: os.environ.get(k) for k in keep}}))
"""


def stand_in(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    path.write_text(text)
    path.chmod(0o755)
    return path


def test_the_sbatch_script_is_valid_bash() -> None:
    subprocess.run(["bash", "-n", str(SBATCH)], check=True)
    directives = [line for line in SBATCH.read_text().splitlines() if line.startswith("#SBATCH")]
    assert "#SBATCH --ntasks-per-node=1" in directives


def test_the_sbatch_script_starts_one_agent_per_node_as_slurm_names_it(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stand_in(bin_dir, "srun", FAKE_SRUN)
    fake = stand_in(bin_dir, "forgeline", FAKE_FORGELINE)
    env = {
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "USER": "trainer",
        "FORGELINE_BIN": str(fake),
        "FORGELINE_TEMPORAL_ADDRESS": "temporal.example:7233",
        "FORGELINE_NODE_HOME": str(tmp_path / "node-disk"),
        "NCCL_IB_HCA": "mlx5",  # an operator's NCCL setting, passed through
        # What Slurm sets in the batch step and in each task.
        "SLURM_JOB_PARTITION": "h100",
        "SLURM_GPUS_PER_NODE": "8",
        "SLURM_GPUS_ON_NODE": "8",
        "SLURMD_NODENAME": "LocalHost",
    }
    done = subprocess.run(["bash", str(SBATCH)], env=env, capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    started = json.loads(done.stdout)
    assert started["argv"] == [
        "agent", "--node-id", "localhost", "--pod", "h100",
        "--advertise-address", "127.0.0.1", "--gpus", "8",
    ]  # fmt: skip
    assert started["env"] == {
        "FORGELINE_HOME": str(tmp_path / "node-disk"),
        "FORGELINE_TEMPORAL_ADDRESS": "temporal.example:7233",
        "NCCL_IB_HCA": "mlx5",
    }
    assert (tmp_path / "node-disk").is_dir()
    check_forgeline_argv(started["argv"])


def test_the_sbatch_script_refuses_to_start_without_temporal(tmp_path: Path) -> None:
    env = {"PATH": os.environ["PATH"]}
    done = subprocess.run(["bash", str(SBATCH)], env=env, capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert done.returncode != 0 and "FORGELINE_TEMPORAL_ADDRESS" in done.stderr


def exec_start(unit: str) -> list[str]:
    (line,) = [x for x in unit.splitlines() if x.startswith("ExecStart=")]
    return line.removeprefix("ExecStart=").split()


def test_the_unit_runs_an_agent_command_that_exists() -> None:
    binary, *argv = exec_start(UNIT.read_text())
    assert binary.endswith("/bin/forgeline")
    # systemd's ${VAR} is one argument, $VAR none or more: here as an empty FORGELINE_AGENT_ARGS.
    values = {"${FORGELINE_NODE_ID}": "gpu-node-017", "${FORGELINE_POD}": "rack-a"}
    check_forgeline_argv(
        [values.get(word, word) for word in argv if word != "$FORGELINE_AGENT_ARGS"]
    )


def test_the_api_unit_serves_the_api_command_that_exists() -> None:
    binary, *argv = exec_start(API_UNIT.read_text())
    assert binary.endswith("/bin/forgeline") and argv[0] == "api"
    values = {"${FORGELINE_API_HOST}": "0.0.0.0", "${FORGELINE_API_PORT}": "8700"}
    check_forgeline_argv([values.get(word, word) for word in argv])
    assert "StateDirectoryMode=0700" in API_UNIT.read_text()  # the tokens: its user's alone


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze here")
@pytest.mark.parametrize("source", [UNIT, API_UNIT], ids=lambda path: path.stem)
def test_the_unit_passes_systemd_analyze_verify(source: Path, tmp_path: Path) -> None:
    """Without a warning: verify exits 0 on unknown keys and bad values too, and says so on
    stderr. The ExecStart binary must exist for it, so the copy names one that does."""
    binary = exec_start(source.read_text())[0]
    unit = tmp_path / source.name
    unit.write_text(source.read_text().replace(binary, shutil.which("bash") or "/bin/bash"))
    done = subprocess.run(["systemd-analyze", "verify", "--man=no", str(unit)],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0 and done.stderr.strip() == "", done.stderr


def example_names(name: str) -> set[str]:
    example = (DEPLOY / "systemd" / name).read_text()
    return {line.lstrip("#").split("=", 1)[0] for line in example.splitlines()
            if "=" in line and not line.startswith("# ")}  # fmt: skip


def test_the_environment_file_example_names_settings_of_the_agent() -> None:
    names = example_names("agent.env.example")
    used_by_unit = {"FORGELINE_NODE_ID", "FORGELINE_POD", "FORGELINE_AGENT_ARGS"}
    assert used_by_unit <= names
    assert "FORGELINE_TEMPORAL_API_KEY" not in names  # the key goes in a file of its own


def test_the_api_environment_file_example_names_what_its_unit_reads() -> None:
    names = example_names("api.env.example")
    assert {"FORGELINE_API_HOST", "FORGELINE_API_PORT", "FORGELINE_TEMPORAL_ADDRESS"} <= names
    assert "FORGELINE_TEMPORAL_API_KEY" not in names
