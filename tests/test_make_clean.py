"""`make clean` deletes the local stack's state folder only after `forgeline down` succeeded,
and says what it deletes: a failed `down` (a process it could not stop) leaves everything.
`forgeline` is a stand-in here (FL=…): what is tested is the target's own logic."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO


def make_clean(folder: Path, forgeline: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["make", "-s", "-f", str(REPO / "Makefile"), "clean", f"FL={forgeline}"],
        cwd=folder, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


@pytest.mark.skipif(shutil.which("make") is None, reason="no make here")
def test_make_clean_deletes_the_state_only_once_the_stack_is_down(tmp_path: Path) -> None:
    state = tmp_path / ".forgeline" / "store"
    state.mkdir(parents=True)
    failed = make_clean(tmp_path, shutil.which("false") or "/bin/false")
    assert failed.returncode != 0 and state.is_dir()  # before: deleted all the same
    assert "`forgeline down` failed, so nothing was deleted" in failed.stderr, failed.stderr
    done = make_clean(tmp_path, shutil.which("true") or "/bin/true")
    assert done.returncode == 0 and not (tmp_path / ".forgeline").exists()
    assert "deleting .forgeline/ (the local stack's store, MLflow" in done.stdout, done.stdout
    assert make_clean(tmp_path, "/nonexistent/forgeline").returncode == 0  # nothing to delete
