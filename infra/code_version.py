"""Which code is running: the git commit of the checkout Forgeline was installed from."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

_SOURCE_ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class CodeVersion:
    commit: str
    dirty: bool


def code_version(root: Path = _SOURCE_ROOT) -> CodeVersion:
    """The commit and dirty flag of `root`, or `unknown` when it is not a git checkout."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(root), *args], capture_output=True, text=True, check=True, timeout=10
        ).stdout.strip()

    try:
        commit = git("rev-parse", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return CodeVersion(commit="unknown", dirty=True)
    return CodeVersion(commit=commit, dirty=dirty)
