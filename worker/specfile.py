"""Read a run spec from TOML and validate it completely before anything is submitted."""

from __future__ import annotations

import datetime as dt
import difflib
import hashlib
import itertools
import json
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from dataprep.errors import SourceError
from dataprep.remote_sources import expand_objects, split_sources
from dataprep.source_roots import DataRoots
from dataprep.source_urls import STORE_SCHEME, is_remote
from dataprep.sources import WalkBudget, expand_sources
from infra.errors import StoreError
from infra.settings import SettingsError, load_settings
from infra.toml_files import read_toml
from workflows.contracts.spec import MAX_PATH_CHARS, NAME_PATTERN, NAME_RULE, RunSpec


class SpecError(Exception):
    """The spec file cannot be used; the message names the field and what is allowed."""


# What a patterned field expects, said the way a person would.
_FORMS = {
    "memory_limit": "a size such as 512MB or 2GB",
    "gpu_type": "a GPU type such as h100 (letters, digits, '.', '_', '-')",
}
_GLOB = re.compile(r"[*?[]")
_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")
# An input quoted in a message is cut to this: a megabyte-long value must not become the message.
_QUOTE_CHARS = 80


def _quote(value: object) -> str:
    text = repr(value)
    return text if len(text) <= _QUOTE_CHARS else f"{text[: _QUOTE_CHARS - 1]}…"


def _key(part: str | int) -> str:
    """A key as a dotted path shows it; quoted when it is not a bare TOML key, so a key with a
    newline or a dot in it cannot break the one-line-per-problem message or fake a path."""
    text = str(part)
    return text if _BARE_KEY.fullmatch(text) else _quote(text)


def _where(path: tuple) -> str:
    return ".".join(_key(part) for part in path) or "(top level)"


def _section(model: type[BaseModel] | None, key: str) -> type[BaseModel] | None:
    """The model class of `key` in `model` (a spec section), or None for a plain field."""
    if model is None or key not in model.model_fields:
        return None
    annotation = model.model_fields[key].annotation
    is_section = isinstance(annotation, type) and issubclass(annotation, BaseModel)
    return annotation if is_section else None


def _field_path(loc: tuple) -> tuple[tuple[str | int, ...], type[BaseModel] | None]:
    """The error's location as the keys a person wrote, and the section model it ends in.

    pydantic adds the branch of a union to the location (`train.checkpoint_every.int`); those
    parts are not keys of the spec and are dropped."""
    model: type[BaseModel] | None = RunSpec
    parent: type[BaseModel] | None = RunSpec
    path: list[str | int] = []
    for part in loc:
        if isinstance(part, int):
            path.append(part)
            model = None
        elif model is not None:
            path.append(part)  # a field of the section, or an unknown key in it
            parent, model = model, _section(model, part)
        # else: a union branch's tag below a plain field
    return tuple(path), parent


def _unknown_key(key: str, section: type[BaseModel] | None) -> str:
    if section is None:
        return "unknown key (check its spelling)"
    known = list(section.model_fields)
    close = difflib.get_close_matches(key, known, n=1)
    if close:
        return f"unknown key: did you mean {close[0]!r}?"
    return f"unknown key: this table takes {', '.join(known)}"


def _explain(errors: list[dict], path: tuple, section: type[BaseModel] | None) -> str:
    """One line for the errors at one place: a union's branches each fail alone ('a valid
    integer', "'auto'") and are said together."""
    where = _where(path)
    error = errors[0]
    kind = error["type"]
    if kind == "extra_forbidden":
        return f"{where}: {_unknown_key(str(path[-1]), section)}"
    if kind == "missing":
        return f"{where}: required but missing"
    if kind == "string_pattern_mismatch" and len(errors) == 1:
        if error["ctx"]["pattern"] == NAME_PATTERN:
            return f"{where}: {_quote(error['input'])} is not a valid name: use {NAME_RULE}"
        form = _FORMS.get(str(path[-1]), f"text matching {error['ctx']['pattern']}")
        return f"{where}: {_quote(error['input'])} is not valid: expected {form}"
    # JSON's words for TOML's things: the spec is validated through JSON (see parse_spec).
    messages = [
        e["msg"].removeprefix("Value error, ").replace("an object", "a TOML table") for e in errors
    ]
    message = messages[0] + "".join(
        f", or {m.removeprefix('Input should be ')}" for m in dict.fromkeys(messages[1:])
    )
    if not path:
        return message  # a check across sections names its fields itself
    if "input" not in error or isinstance(error["input"], dict):
        # A check across a table's fields quotes the values it needs; the table is too much.
        return f"{where}: {message}"
    return f"{where}: {message} (got {_quote(error['input'])})"


def explain_errors(err: ValidationError) -> str:
    """One line per problem, each naming the field and what is allowed."""
    found: dict[tuple, tuple[list[dict], type[BaseModel] | None]] = {}
    for error in err.errors(include_url=False):
        path, section = _field_path(error["loc"])
        found.setdefault(path, ([], section))[0].append(error)
    return "\n  ".join(_explain(errors, path, section) for path, (errors, section) in found.items())


# The deepest value of a spec is data.filters.max_top_ngram_char_fraction[i][j]: 5 levels.
_MAX_DEPTH = 16


def _unusable_values(data: Any, path: tuple = ()) -> Iterator[str]:
    """Values no spec key takes, found before validation: TOML dates and times, and nesting so
    deep that the validator's JSON reader would stop with a message about JSON."""
    if len(path) > _MAX_DEPTH:
        yield f"{_where(path)}: nested more than {_MAX_DEPTH} levels deep; no spec value does"
    elif isinstance(data, dict):
        for key, value in data.items():
            yield from _unusable_values(value, (*path, key))
    elif isinstance(data, list):
        for index, value in enumerate(data):
            yield from _unusable_values(value, (*path, index))
    elif isinstance(data, dt.date | dt.time):  # datetime is a date
        yield f"{_where(path)}: a TOML date or time ({data}) is not a value any spec key takes"


def _resolved(source: object, spec_dir: Path | None, key: str) -> object:
    """Absolute and normalised, against the spec's folder. Not Path.resolve: it raises on a
    symlink loop and follows links the reader would report by the name the user wrote. A spec
    with no folder (sent to the API) must say where a file is."""
    if (
        not isinstance(source, str)
        or not source
        or "\x00" in source
        or len(source) > MAX_PATH_CHARS
    ):
        return source  # validation reports it, by the value the user wrote
    if is_remote(source):
        return source  # an object's URL or a store key: no folder of this machine's
    if spec_dir is None:
        if not os.path.isabs(source):
            raise SpecError(
                f"invalid run spec:\n  {key}: {_quote(source)} is relative, and a spec sent "
                "to the API has no folder to be relative to: give an absolute path the "
                "cluster's workers can read, an s3:// URL or a store:KEY object"
            )
        return os.path.normpath(source)
    return os.path.abspath(spec_dir / source)


def parse_spec(data: dict, spec_dir: Path | None, overrides: dict | None = None) -> RunSpec:
    """Validate a spec; data sources become absolute paths, resolved against the spec's folder
    (None: a spec with no file, whose paths must be absolute).

    Types are strict: TOML says what each value is, so `steps = true` or `preemptible = "no"`
    are mistakes to report, not values to coerce (lax validation makes them 1 and False)."""
    data = {**data, **(overrides or {})}
    sources = data.get("data", {}).get("sources") if isinstance(data.get("data"), dict) else None
    if isinstance(sources, list):
        resolved = [_resolved(s, spec_dir, "data.sources") for s in sources]
        data["data"] = {**data["data"], "sources": resolved}
    train = data.get("train")
    if isinstance(train, dict) and "code" in train:
        data["train"] = {**train, "code": _resolved(train["code"], spec_dir, "train.code")}
    if unusable := list(_unusable_values(data)):
        raise SpecError("invalid run spec:\n  " + "\n  ".join(unusable))
    try:
        # Through JSON because strict Python validation refuses TOML's arrays for tuple fields.
        return RunSpec.model_validate_json(json.dumps(data), strict=True)
    except ValidationError as err:
        raise SpecError(f"invalid run spec:\n  {explain_errors(err)}") from None


def load_spec(path: Path, overrides: dict | None = None) -> RunSpec:
    data = read_toml(path, SpecError, "spec file")
    spec = parse_spec(data, path.resolve().parent, overrides)
    check_sources(spec)
    return spec


@dataclass(frozen=True)
class SourceBounds:
    """Where a check of data.sources may look for a spec from anyone (the API's): inside the data
    roots only, at most `max_entries` directory entries, `store:` keys in `store_url`; and never
    at train.code, a folder of the submitter's machine that its uploaded snapshot stands for."""

    roots: tuple[str, ...]
    store_url: str
    max_entries: int


def check_sources(spec: RunSpec, bounds: SourceBounds | None = None) -> None:
    """What the spec names exists, as the data workers and nodes will look for it: within
    `bounds` (raising WalkTooLong past its entries), or anywhere on this machine without."""
    budget = None
    if bounds is not None:
        refuse_outside_roots(spec, bounds.roots, follow_links=True)
        roots = DataRoots.of(bounds.roots)
        budget = WalkBudget(bounds.max_entries, lambda path: roots.holds(os.path.realpath(path)))
    local = [s for s in spec.data.sources if not is_remote(s)]
    missing = [s for s in local if not _GLOB.search(s) and not os.path.exists(s)]
    if missing:
        raise SpecError(f"invalid run spec:\n  data.sources: no such file: {', '.join(missing)}")
    if spec.train.code is not None and bounds is None:
        _check_user_code(spec)
    # The data workers expand the sources the same way; a pattern that names nothing is found
    # here, before the run is submitted, rather than minutes later in its dataset workflow.
    try:
        expand_sources(local, budget)
        remote = [s for s in spec.data.sources if is_remote(s)]
        _check_objects(remote, bounds.store_url if bounds else None, budget)
    except (SourceError, StoreError, SettingsError) as err:
        raise SpecError(f"invalid run spec:\n  data.sources: {err}") from None


def refuse_outside_roots(spec: RunSpec, roots: Sequence[str], follow_links: bool = False) -> None:
    """Every local source starts inside a data root: the folders before its first wildcard, as
    written (or, with `follow_links`, once every link on the way is resolved). The refusal names
    the roots and says nothing of what is, or is not, outside them."""
    written = DataRoots(tuple(os.path.normpath(r) for r in roots if r))
    resolved = DataRoots.of(roots)
    for source in (s for s in spec.data.sources if not is_remote(s)):
        start = walk_start(source)
        if follow_links:
            inside = resolved.holds(os.path.realpath(start))
        else:
            inside = written.holds(start) or resolved.holds(start)
        if not inside:
            raise SpecError(
                f"invalid run spec:\n  data.sources: {_quote(source)} is outside the data roots "
                f"({', '.join(resolved.folders)}){' through a link' if follow_links else ''}: "
                "name files inside one of them, an s3:// URL or a store:KEY object (an operator "
                "adds folders to the data workers' and the API's FORGELINE_DATA_ROOTS)"
            )


def walk_start(pattern: str) -> str:
    """The folders of a pattern before its first wildcard: where expanding it starts."""
    literal = list(itertools.takewhile(lambda p: not _GLOB.search(p), Path(pattern).parts))
    return os.path.join(*literal) if literal else os.sep


def _check_objects(sources: list[str], store_url: str | None, budget: WalkBudget | None) -> None:
    """Each s3:// and store: source names at least one object, listed from here with this
    machine's AWS settings: a data worker elsewhere reads them with its own. `store:` keys are
    in `store_url` (None: this machine's settings' store)."""
    if store_url is None and any(s.startswith(STORE_SCHEME) for s in sources):
        store_url = load_settings().store
    for source in sources:
        try:
            in_store, s3 = split_sources([source], store_url or "")
            expand_sources(in_store, budget)  # store: sources of a local store are its files
            expand_objects(s3)
        except (SourceError, StoreError) as err:
            if not source.startswith(STORE_SCHEME):
                raise
            # The message names the place the key resolved to; say which entry that was.
            raise type(err)(f"{source} (in the store {store_url}): {err}") from None


def _check_user_code(spec: RunSpec) -> None:
    """The code folder and its script exist: found now, not on 64 ranks after the queue."""
    code, entry = Path(spec.train.code or ""), spec.train.entrypoint or ""
    if not code.is_dir():
        raise SpecError(f"invalid run spec:\n  train.code: no such folder: {code}")
    if ":" not in entry and not (code / entry).is_file():
        raise SpecError(
            f"invalid run spec:\n  train.entrypoint: no file {entry!r} in train.code ({code})"
        )


def spec_sha256(spec: RunSpec) -> str:
    return hashlib.sha256(json.dumps(spec.model_dump(), sort_keys=True).encode()).hexdigest()


def differing_keys(before: RunSpec, after: RunSpec) -> list[str]:
    """Every key whose value differs (dotted as in the TOML), without the values: `before`
    may be another team's spec."""
    old, new = _flat(before.model_dump(mode="json")), _flat(after.model_dump(mode="json"))
    return [key for key in sorted(old.keys() | new.keys()) if old.get(key) != new.get(key)]


def _flat(data: dict, prefix: str = "") -> dict[str, object]:
    flat: dict[str, object] = {}
    for key, value in data.items():
        if isinstance(value, dict) and value:
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat
