"""bench/gpu_first_contact.sh, the first run on a GPU machine, rehearsed on CPU
(FIRST_CONTACT_CPU=1): every check records a result, none that ran failed, and only what needs
CUDA is skipped. Without CUDA and without the rehearsal the script refuses at once; a check
that dies without a result is recorded as failed, and fails the script."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.first_contact import NEEDS_CUDA, RECORDS, RESULTS

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "bench" / "gpu_first_contact.sh"
# What needs CUDA in the rehearsal: everything else runs on two gloo ranks.
CUDA_ONLY = {"process_group_nccl", "gpu_sh"}


def _env(work: Path, **extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHON": sys.executable, "WORK": str(work), "OUT": str(work / "out"),
            **extra}  # fmt: skip


def _results(work: Path) -> dict[str, dict]:
    lines = (work / "out" / RESULTS).read_text().splitlines()
    return {r["check"]: r for r in map(json.loads, lines)}


@pytest.mark.slow
def test_the_rehearsal_records_every_check_and_none_that_ran_failed(tmp_path: Path) -> None:
    done = subprocess.run(
        ["bash", str(SCRIPT)], env=_env(tmp_path, FIRST_CONTACT_CPU="1"), cwd=REPO,
        capture_output=True, text=True, timeout=420,
    )  # fmt: skip
    output = done.stdout + done.stderr
    results = _results(tmp_path)
    expected = {name for names in RECORDS.values() for name in names}
    assert set(results) == expected, output[-4000:]
    failed = {name: r["error"] for name, r in results.items() if not r["ok"]}
    assert not failed, output[-4000:]
    assert {n for n, r in results.items() if r["skipped"]} == CUDA_ONLY, output[-4000:]
    assert all(results[n]["skipped"] == NEEDS_CUDA for n in CUDA_ONLY)
    assert done.returncode == 0, output[-4000:]
    # What the checks found, not only that they ran.
    assert results["job"]["figures"]["warm_standby"] and results["job"]["figures"]["steps"] == 3
    assert results["checkpoint"]["figures"]["mismatched"] == {}
    assert results["shadow_drift"]["figures"]["eager_vs_eager"] == 0.0  # CPU kernels: bitwise
    assert results["ddp_compile_shadow"]["figures"]["agreed_at"] == [1, 2]
    assert "0 failed" in done.stdout


def test_without_cuda_or_the_rehearsal_it_stops_at_once(tmp_path: Path) -> None:
    done = subprocess.run(
        ["bash", str(SCRIPT)], env=_env(tmp_path, CUDA_VISIBLE_DEVICES=""), cwd=REPO,
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2
    assert "no CUDA device" in done.stderr and "FIRST_CONTACT_CPU=1" in done.stderr
    assert not (tmp_path / "out" / RESULTS).exists()


def test_a_check_that_died_without_a_result_is_a_failure(tmp_path: Path) -> None:
    """`settle` after a check killed past its timeout; `summary` then fails the script."""
    env = _env(tmp_path)

    def command(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "bench.first_contact", *args], env=env,
                              cwd=REPO, capture_output=True, text=True, timeout=60)  # fmt: skip

    log = tmp_path / "job.log"
    log.write_text("the rank's last words\n")
    assert command("settle", "process_groups", "--rc", "124", "--log", str(log)).returncode == 0
    results = _results(tmp_path)
    assert set(results) == {"process_group_nccl", "process_group_gloo"}
    assert all(not r["ok"] and "timed out" in r["error"] for r in results.values())
    assert "the rank's last words" in results["process_group_gloo"]["error"]
    table = command("summary")
    assert table.returncode == 1
    assert "MISS" in table.stdout and "FAIL" in table.stdout
