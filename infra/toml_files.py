"""Reading the TOML files people write (specs, cluster, planning and simulation settings):
one place that turns a missing or malformed file into one line naming it."""

from __future__ import annotations

import tomllib
from pathlib import Path


def read_toml(path: Path, error: type[Exception], what: str = "file") -> dict:
    """The file's table, or `error` saying which file is missing or where its TOML breaks."""
    try:
        return tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise error(f"{what} {path} does not exist") from None
    except tomllib.TOMLDecodeError as err:
        raise error(f"{path} is not valid TOML: {err}") from None
    except OSError as err:
        raise error(f"cannot read {what} {path}: {err.strerror}") from None
