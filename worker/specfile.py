"""Read a run spec from TOML and validate it completely before anything is submitted."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from pydantic import ValidationError

from infra.toml_files import read_toml
from workflows.spec import NAME_PATTERN, NAME_RULE, RunSpec


class SpecError(Exception):
    """The spec file cannot be used; the message names the field and what is allowed."""


# What a patterned field expects, said the way a person would.
_FORMS = {"memory_limit": "a size such as 512MB or 2GB"}


def _explain(error: dict) -> str:
    where = ".".join(str(part) for part in error["loc"]) or "(top level)"
    kind = error["type"]
    if kind == "extra_forbidden":
        return f"{where}: unknown key (check its spelling)"
    if kind == "missing":
        return f"{where}: required but missing"
    if kind == "string_pattern_mismatch":
        if error["ctx"]["pattern"] == NAME_PATTERN:
            return f"{where}: {error['input']!r} is not a valid name: use {NAME_RULE}"
        form = _FORMS.get(str(error["loc"][-1]), f"text matching {error['ctx']['pattern']}")
        return f"{where}: {error['input']!r} is not valid: expected {form}"
    message = error["msg"].removeprefix("Value error, ")
    return f"{where}: {message} (got {error['input']!r})" if "input" in error else message


def explain_errors(err: ValidationError) -> str:
    """One line per problem, each naming the field and what is allowed."""
    return "\n  ".join(_explain(e) for e in err.errors(include_url=False))


def parse_spec(data: dict, spec_dir: Path, overrides: dict | None = None) -> RunSpec:
    """Validate a spec; data sources become absolute paths, resolved against the spec's folder."""
    data = {**data, **(overrides or {})}
    sources = data.get("data", {}).get("sources") if isinstance(data.get("data"), dict) else None
    if isinstance(sources, list):
        data["data"] = {
            **data["data"],
            "sources": [
                str((spec_dir / s).resolve()) if isinstance(s, str) else s for s in sources
            ],
        }
    try:
        return RunSpec.model_validate(data)
    except ValidationError as err:
        raise SpecError(f"invalid run spec:\n  {explain_errors(err)}") from None


def load_spec(path: Path, overrides: dict | None = None) -> RunSpec:
    data = read_toml(path, SpecError, "spec file")
    spec = parse_spec(data, path.resolve().parent, overrides)
    missing = [s for s in spec.data.sources if not Path(s).is_file()]
    if missing:
        raise SpecError(f"invalid run spec:\n  data.sources: no such file: {', '.join(missing)}")
    return spec


def spec_sha256(spec: RunSpec) -> str:
    return hashlib.sha256(json.dumps(spec.model_dump(), sort_keys=True).encode()).hexdigest()
