"""Which code is running: the git commit of the checkout Forgeline was installed from."""

from __future__ import annotations

import hashlib
import subprocess
from dataclasses import dataclass
from importlib import metadata
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


def installed_packages() -> list[str]:
    """`name==version` of every distribution in this environment, sorted: what a model's code
    ran with besides Forgeline's own commit."""
    found = {
        f"{(dist.metadata['Name'] or '?').lower()}=={dist.version}"
        for dist in metadata.distributions()
    }
    return sorted(found)


def packages_digest(packages: list[str]) -> str:
    """One hash for the whole environment: two versions tagged with the same digest ran on the
    same package versions (the list itself is logged beside it)."""
    return hashlib.sha256("\n".join(packages).encode()).hexdigest()
