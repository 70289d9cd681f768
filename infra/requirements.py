"""A training script's declared requirements against this node's environment, before launch.

A package missing on a node is one line that names it, found before torchrun starts, instead of
the same ImportError traceback from every one of 64 ranks.
"""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement

REQUIREMENTS_FILE = "requirements.txt"


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


def unmet(code_dir: Path) -> list[str]:
    """What the code folder's requirements.txt asks for that this environment lacks, said as a
    person would fix it; empty when all is there (or there is no such file)."""
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
