"""The `forgeline` CLI starts without importing torch: every command a person (or a test
driving the stack) types pays the CLI's imports, and torch's are more than a second of them.
A module the CLI imports that pulled torch in once (trainer.script_folder through
trainer.step_share) made every command 1.2 s slower, and the end-to-end tests that react to a
run in flight too late to catch it."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO


def test_the_cli_imports_no_torch() -> None:
    loaded = subprocess.run(
        [sys.executable, "-c", "import sys, worker.cli; print(sorted(m for m in sys.modules "
         "if m == 'torch' or m.startswith('torch.')))"],
        cwd=REPO, capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert loaded.stdout.strip() == "[]", "worker.cli imports torch"
