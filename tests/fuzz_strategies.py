"""Hypothesis strategies for the bad-input fuzz tests: values of the wrong type or out of range,
names that try to escape their folder, mutations of the example specs, and a small TOML writer
so a mutated spec can be fed to the CLI as a file."""

from __future__ import annotations

import copy
import datetime as dt
import json
import math
import os
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from dataprep.readers import UNICODE_SPACES
from tests.conftest import REPO
from workflows.contracts.spec import RunSpec

EXAMPLES = REPO / "examples"
SPEC_EXAMPLES = ("shakespeare-char.toml", "tiny.toml", "tiny-fsdp.toml")

# Fast enough for 2 busy cores; the temporary folder a test reuses across examples is fine to
# share because every example writes its own files before it reads them. The same cases every
# run, so CI is reproducible; FORGELINE_EXPLORE=1 searches new ones (and FORGELINE_FUZZ_SCALE=10
# tries ten times as many).
SCALE = float(os.environ.get("FORGELINE_FUZZ_SCALE", "1"))
FUZZ = settings(
    max_examples=200,
    deadline=None,
    derandomize=not os.environ.get("FORGELINE_EXPLORE"),
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def fuzz(max_examples: int) -> settings:
    # Half the cases of the first hunt (which found the 25 bugs) in the default run.
    return settings(FUZZ, max_examples=max(5, int(max_examples * SCALE / 2)))


# --- values and names ---------------------------------------------------------------------

EDGE_NUMBERS = [0, -1, 1, 2**31, 2**63, -(2**63) - 1, 10**30, -(10**30)]
EDGE_FLOATS = [math.inf, -math.inf, math.nan, 0.0, -0.0, 1e308, 5e-324, 0.5]
ESCAPES = ["..", ".", "../x", "a/b", "/abs", "a\\b", "a\x00b", "\x00", " a", "a ", "a\n", "\n",
           ".hidden", "-x", "_x", "A", "é", "ａ", "a" * 64, "\u202e", "CON", ".tmp-x"]  # fmt: skip


def wrong_values() -> st.SearchStrategy[Any]:
    """Anything a TOML file (or a careless caller) can put where a spec value goes."""
    scalars = st.one_of(
        st.booleans(),
        st.sampled_from(EDGE_NUMBERS),
        st.integers(min_value=-(10**40), max_value=10**40),
        st.sampled_from(EDGE_FLOATS),
        st.floats(),
        st.text(max_size=40),
        st.sampled_from(ESCAPES),
        st.builds(lambda n: "x" * n, st.sampled_from([1000, 5000, 100_000])),  # huge strings
        st.dates(),
        st.datetimes(),
        st.times(),
    )
    return st.one_of(
        scalars,
        st.lists(scalars, max_size=3),
        st.dictionaries(st.text(max_size=8), scalars, max_size=2),
    )


def escaping_names() -> st.SearchStrategy[str]:
    """Names a user might type, or an attacker might: separators, dots, spaces, unicode."""
    pieces = st.sampled_from(
        ["a", "z", "0", "9", ".", "..", "_", "-", "/", "\\", " ", "\t", "\n", "\x00", "é", "Ω",
         "A", "~", "$", "%2e", UNICODE_SPACES[-1]]
    )  # fmt: skip
    return st.one_of(
        st.sampled_from(ESCAPES),
        st.lists(pieces, min_size=0, max_size=12).map("".join),
        st.text(max_size=80),
        st.from_regex(r"[a-z0-9][a-z0-9._-]{0,70}", fullmatch=True),  # near-valid, some too long
    )


# --- specs --------------------------------------------------------------------------------


def example_toml(name: str) -> dict:
    return tomllib.loads((EXAMPLES / name).read_text())


def _sections(model: type[BaseModel], prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    out = [prefix] if prefix else []
    for key, field in model.model_fields.items():
        kind = field.annotation
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            out += _sections(kind, (*prefix, key))
    return out


def _leaves(model: type[BaseModel], prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    out = []
    for key, field in model.model_fields.items():
        kind = field.annotation
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            out += _leaves(kind, (*prefix, key))
        else:
            out.append((*prefix, key))
    return out


SPEC_SECTIONS = _sections(RunSpec)  # ("data",), ("data", "filters"), ("model",), …
SPEC_FIELDS = _leaves(RunSpec)  # ("name",), ("data", "sources"), ("train", "steps"), …
REQUIRED = [("name",), ("data",), ("data", "sources")]


@dataclass(frozen=True)
class Mutation:
    """One change to a valid spec: what was changed, where, and to what."""

    kind: str  # "value" | "unknown-key" | "delete" | "section"
    path: tuple[str, ...]
    value: Any = None

    def apply(self, spec: dict) -> dict:
        out = copy.deepcopy(spec)
        *parents, last = self.path
        table = out
        for key in parents:
            if not isinstance(table.get(key), dict):
                table[key] = {}
            table = table[key]
        if self.kind == "delete":
            table.pop(last, None)
        else:
            table[last] = self.value
        return out

    @property
    def dotted(self) -> str:
        return ".".join(self.path)


def _unknown_key(section: tuple[str, ...]) -> st.SearchStrategy[Mutation]:
    known = {path[len(section)] for path in SPEC_FIELDS + SPEC_SECTIONS if path[:-1] == section}
    keys = st.one_of(
        st.from_regex(r"[a-z_]{1,20}", fullmatch=True),
        st.sampled_from(["step", "batchsize", "lr", "Steps", "n_layers", "pipeline"]),
    ).filter(lambda k: k not in known)
    return st.builds(lambda k, v: Mutation("unknown-key", (*section, k), v), keys, wrong_values())


def mutations() -> st.SearchStrategy[Mutation]:
    return st.one_of(
        st.builds(
            lambda path, value: Mutation("value", path, value),
            st.sampled_from(SPEC_FIELDS),
            wrong_values(),
        ),
        st.sampled_from([(), *SPEC_SECTIONS]).flatmap(_unknown_key),
        st.builds(lambda path: Mutation("delete", path), st.sampled_from(REQUIRED + SPEC_FIELDS)),
        st.builds(
            lambda path, value: Mutation("section", path, value),
            st.sampled_from(SPEC_SECTIONS),
            wrong_values(),
        ),
    )


def mutated_specs(max_mutations: int = 3) -> st.SearchStrategy[tuple[dict, list[Mutation]]]:
    """(spec data, the mutations applied) from one of the examples."""

    def build(name: str, changes: list[Mutation]) -> tuple[dict, list[Mutation]]:
        data = example_toml(name)
        for change in changes:
            data = change.apply(data)
        return data, changes

    return st.builds(
        build,
        st.sampled_from(SPEC_EXAMPLES),
        st.lists(mutations(), min_size=1, max_size=max_mutations),
    )


# --- any TOML file people write, and its bytes ---------------------------------------------------


def _paths(data: dict, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    out = []
    for key, value in data.items():
        out.append((*prefix, key))
        if isinstance(value, dict):
            out += _paths(value, (*prefix, key))
    return out


def toml_mutations(data: dict) -> st.SearchStrategy[Mutation]:
    """Changes to one of the file's own keys or tables (the file has no model to draw from)."""
    paths = _paths(data)
    tables = [(), *(p for p in paths if isinstance(_get(data, p), dict))]
    keys = st.from_regex(r"[a-z_]{1,12}", fullmatch=True)
    return st.one_of(
        st.builds(lambda p, v: Mutation("value", p, v), st.sampled_from(paths), wrong_values()),
        st.builds(
            lambda t, k, v: Mutation("unknown-key", (*t, f"x_{k}"), v),
            st.sampled_from(tables),
            keys,
            wrong_values(),
        ),
        st.builds(lambda p: Mutation("delete", p), st.sampled_from(paths)),
    )


def _get(data: dict, path: tuple[str, ...]) -> Any:
    for key in path:
        data = data[key]
    return data


def mutated_toml(name: str, max_mutations: int = 2) -> st.SearchStrategy[dict]:
    """An example file's table with a few of its keys changed, added or removed."""
    base = example_toml(name)

    def build(changes: list[Mutation]) -> dict:
        data = base
        for change in changes:
            data = change.apply(data)
        return data

    return st.lists(toml_mutations(base), min_size=1, max_size=max_mutations).map(build)


def damaged_bytes(raw: bytes, max_edits: int = 4) -> st.SearchStrategy[bytes]:
    """`raw` with a few bytes flipped, inserted, or everything after a point cut off: bad
    UTF-8, broken TOML, stray keys, a file cut short."""
    edit = st.tuples(
        st.sampled_from(["flip", "cut", "insert"]),
        st.floats(0, 1),
        st.binary(min_size=1, max_size=8),
    )

    def apply(edits: list[tuple[str, float, bytes]]) -> bytes:
        out = bytearray(raw)
        for kind, where, data in edits:
            at = int(where * len(out))
            if kind == "flip" and at < len(out):
                out[at] = data[0]
            elif kind == "cut":
                del out[at:]
            else:
                out[at:at] = data
        return bytes(out)

    return st.lists(edit, min_size=1, max_size=max_edits).map(apply)


# --- TOML ----------------------------------------------------------------------------------


def toml_value(value: Any) -> str:
    """A TOML literal for `value` (inline tables for dicts); None has no TOML form."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        # JSON's escapes are TOML's, once DEL (a control character TOML refuses raw) is escaped.
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(value, dt.date | dt.time):
        return value.isoformat()
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value if v is not None) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(
            f"{toml_value(str(k))} = {toml_value(v)}" for k, v in value.items() if v is not None
        ) + "}"  # fmt: skip
    raise TypeError(f"no TOML for {value!r}")


def toml_document(data: dict) -> str:
    return "".join(
        f"{toml_value(str(k))} = {toml_value(v)}\n" for k, v in data.items() if v is not None
    )


def write_spec(folder: Path, data: dict, name: str = "spec.toml") -> Path:
    """The spec as a TOML file whose sources (relative ones) resolve to the examples' data."""
    data = copy.deepcopy(data)
    section = data.get("data")
    if isinstance(section, dict) and isinstance(section.get("sources"), list):
        section["sources"] = [
            str(EXAMPLES / s) if isinstance(s, str) and s.startswith("data/") else s
            for s in section["sources"]
        ]
    path = folder / name
    path.write_text(toml_document(data), encoding="utf-8")
    return path
