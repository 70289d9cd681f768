"""The installed Forgeline's version, as its distribution's metadata says."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version


def forgeline_version() -> str | None:
    """None where it runs from a checkout that was never installed."""
    try:
        return version("forgeline")
    except PackageNotFoundError:
        return None
