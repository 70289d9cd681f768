"""Which install extra a command or process needs, and a one-line error when it is missing.

A GPU host installs the base package only (the CLI and the agent); the data workers, the control
worker and the local stack each add an extra of pyproject.toml. The extras' contents are read
from the installed package's own metadata, so pyproject.toml stays the one list of them.
"""

from __future__ import annotations

from importlib import metadata

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from infra.errors import InfraError

PROJECT = "forgeline"


class MissingExtra(InfraError):
    """A command needs an extra this install lacks; the message names the extra to install."""


def extra_requirements(extra: str, project: str = PROJECT) -> list[Requirement]:
    """The requirements `project[extra]` adds, with the extras it names unfolded
    (`all` = `forgeline[control,data,plots]`). Empty when the project is not installed."""
    try:
        declared = metadata.requires(project) or []
    except metadata.PackageNotFoundError:
        return []
    found: list[Requirement] = []
    for raw in declared:
        req = Requirement(raw)
        if req.marker is None or not req.marker.evaluate({"extra": extra}):
            continue
        if canonicalize_name(req.name) == canonicalize_name(project):
            for inner in sorted(req.extras):
                found += extra_requirements(inner, project)
        else:
            found.append(req)
    return found


def missing_distributions(extra: str, project: str = PROJECT) -> list[str]:
    """The distributions of `project[extra]` that are not installed, by name."""
    missing = []
    for req in extra_requirements(extra, project):
        try:
            metadata.distribution(req.name)
        except metadata.PackageNotFoundError:
            missing.append(req.name)
    return sorted(set(missing))


def require_extra(extra: str, needed_by: str, project: str = PROJECT) -> None:
    """Raise MissingExtra, naming the extra and the pip command, unless it is installed."""
    missing = missing_distributions(extra, project)
    if missing:
        raise MissingExtra(
            f"{needed_by} needs {project}[{extra}] ({', '.join(missing)} not installed): "
            f"pip install '{project}[{extra}]'"
        )
