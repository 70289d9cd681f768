"""Reading the TOML files people write (specs, cluster, planning and simulation settings):
one place that turns a missing or malformed file into one line naming it."""

from __future__ import annotations

import tomllib
from pathlib import Path


def read_toml(path: Path, error: type[Exception], what: str = "file") -> dict:
    """The file's table, or `error` saying which file is missing or where its TOML breaks."""
    try:
        # TOML is UTF-8 by definition, whatever the locale says.
        return tomllib.loads(path.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        raise error(f"{what} {path} does not exist") from None
    except UnicodeDecodeError as err:
        raise error(
            f"{what} {path} is not UTF-8 text (a bad byte at offset {err.start}): TOML files "
            "are UTF-8"
        ) from None
    except tomllib.TOMLDecodeError as err:
        raise error(f"{path} is not valid TOML: {err}") from None
    except RecursionError:  # tomllib recurses per level of nesting
        raise error(f"{path}: arrays or tables nested too deeply to read") from None
    except OSError as err:
        raise error(f"cannot read {what} {path}: {err.strerror or err}") from None
    except ValueError as err:  # a NUL in the path: no file can have that name
        raise error(f"{what} {path!r} is not a usable path: {err}") from None
