"""What a code folder declares it needs besides Forgeline: a `requirements.txt`, or a
`pyproject.toml` with its `uv.lock`. The node agent builds a Python environment from it
(infra.user_envs); this module only reads the folder.
"""

from __future__ import annotations

import hashlib
import tomllib
from dataclasses import dataclass
from enum import StrEnum
from importlib import metadata
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

REQUIREMENTS_FILE = "requirements.txt"
PYPROJECT_FILE = "pyproject.toml"
LOCK_FILE = "uv.lock"


class DeclaredKind(StrEnum):
    REQUIREMENTS = "requirements"  # requirements.txt, resolved when the environment is built
    LOCK = "lock"  # pyproject.toml with uv.lock: the locked versions, exactly


@dataclass(frozen=True)
class DeclaredEnvironment:
    """A code folder's declaration of its own environment."""

    kind: DeclaredKind
    file: Path  # the file whose bytes say what is installed: requirements.txt, or uv.lock
    sha256: str  # of those bytes
    # What the user asks for by name, not what that brings along: a package the node provides
    # (torch) is installed in the environment only when asked for here in a version the node's
    # is not.
    named: tuple[Requirement, ...]


def declared(code_dir: Path) -> list[tuple[int, str]]:
    """The requirement lines of the code folder's requirements.txt, with their line numbers:
    comments, blank lines and pip options (-r, --index-url) left out; none without the file."""
    path = code_dir / REQUIREMENTS_FILE
    if not path.is_file():
        return []
    found = []
    for number, raw in enumerate(path.read_text(errors="replace").splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if line and not line.startswith("-"):
            found.append((number, line))
    return found


def declared_environment(code_dir: Path) -> DeclaredEnvironment | None:
    """What `code_dir` declares (a uv.lock beside its pyproject.toml first: it is exact); None
    when it declares nothing and runs with the node's own packages."""
    lock = code_dir / LOCK_FILE
    if lock.is_file() and (code_dir / PYPROJECT_FILE).is_file():
        return DeclaredEnvironment(
            DeclaredKind.LOCK, lock, _sha256(lock), _names(_project_dependencies(code_dir))
        )
    requirements = code_dir / REQUIREMENTS_FILE
    if requirements.is_file():
        lines = [line for _number, line in declared(code_dir)]
        return DeclaredEnvironment(
            DeclaredKind.REQUIREMENTS, requirements, _sha256(requirements), _names(lines)
        )
    return None


def _project_dependencies(code_dir: Path) -> list[str]:
    """The project's own dependencies, its optional ones included (a lock holds them all)."""
    try:
        project = tomllib.loads((code_dir / PYPROJECT_FILE).read_text()).get("project", {})
    except tomllib.TOMLDecodeError:
        return []  # uv says what is wrong with it when it reads the lock's project
    optional = project.get("optional-dependencies", {})
    return [*project.get("dependencies", []), *(r for group in optional.values() for r in group)]


def _names(lines: list[str]) -> tuple[Requirement, ...]:
    """The requirements the lines name; a line that is no requirement names none (uv says
    what is wrong with it when it builds)."""
    found = []
    for line in lines:
        try:
            found.append(Requirement(line))
        except InvalidRequirement:
            continue
    return tuple(found)


def node_serves(wanted: DeclaredEnvironment, name: str, version: str) -> bool:
    """Whether the node's `version` of distribution `name` is what `wanted` asks for of it
    (nothing, or a range it is in; never a URL)."""
    asked = [r for r in wanted.named if canonicalize_name(r.name) == canonicalize_name(name)]
    return all(
        r.url is None and r.specifier.contains(version, prereleases=True)
        for r in asked
        if r.marker is None or r.marker.evaluate()
    )


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def unmet(code_dir: Path) -> list[str]:
    """What the code folder's requirements.txt asks for that this environment lacks, said as a
    person would fix it; empty when all is there (or there is no such file): such a run needs
    no environment of its own."""
    problems = []
    for number, line in declared(code_dir):
        try:
            wanted = Requirement(line)
        except InvalidRequirement as err:
            problems.append(f"{REQUIREMENTS_FILE} line {number}: {line!r} is not a requirement "
                            f"({str(err).splitlines()[0]})")  # fmt: skip
            continue
        if wanted.marker is not None and not wanted.marker.evaluate():
            continue
        try:
            found = metadata.version(wanted.name)
        except metadata.PackageNotFoundError:
            problems.append(f"{wanted} is not installed")
            continue
        if wanted.specifier and not wanted.specifier.contains(found, prereleases=True):
            problems.append(f"{wanted} is wanted but {wanted.name} {found} is installed")
    return problems
