"""Expand `data.sources` (files, directories, globs) into a sorted list of typed source files.

The result is sorted by path and deduplicated because the order of the files is part of the
dataset's identity: the same patterns over the same tree must always give the same list.
"""

from __future__ import annotations

import fnmatch
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import PurePath
from typing import Literal

from dataprep.errors import SourceError

SourceFormat = Literal["text", "jsonl", "parquet", "code"]

TEXT_EXTENSIONS = frozenset({"txt", "md", "rst", "text"})
JSONL_EXTENSIONS = frozenset({"jsonl", "json", "ndjson"})  # each also with ".gz"
PARQUET_EXTENSIONS = frozenset({"parquet"})
CODE_LANGUAGES: dict[str, str] = {
    "py": "python",
    "pyi": "python",
    "c": "c",
    "h": "c",  # also C++ headers; C is the common denominator
    "cc": "cpp",
    "cpp": "cpp",
    "cxx": "cpp",
    "hh": "cpp",
    "hpp": "cpp",
    "hxx": "cpp",
    "java": "java",
    "js": "javascript",
    "mjs": "javascript",
    "cjs": "javascript",
    "jsx": "javascript",
    "ts": "typescript",
    "tsx": "typescript",
    "go": "go",
    "rs": "rust",
    "rb": "ruby",
    "sh": "shell",
    "bash": "shell",
    "zsh": "shell",
    "sql": "sql",
    "scala": "scala",
    "kt": "kotlin",
    "kts": "kotlin",
    "swift": "swift",
    "php": "php",
    "cs": "csharp",
    "lua": "lua",
    "pl": "perl",
    "pm": "perl",
    "r": "r",
    "jl": "julia",
    "hs": "haskell",
    "ml": "ocaml",
    "mli": "ocaml",
    "toml": "toml",
    "yaml": "yaml",
    "yml": "yaml",
}

# Vendored, generated and tool folders hold no corpus and can be huge; hidden names too.
_SKIPPED_NAMES = frozenset({"__pycache__", "node_modules"})
GLOB_MAGIC = re.compile(r"[*?[]")


@dataclass(frozen=True, order=True)
class SourceFile:
    path: str  # absolute path
    format: SourceFormat
    language: str | None = None  # for code files, e.g. "python", "c", "javascript"


def known_extensions() -> list[str]:
    gz = [f".{ext}.gz" for ext in sorted(JSONL_EXTENSIONS)]
    plain = TEXT_EXTENSIONS | JSONL_EXTENSIONS | PARQUET_EXTENSIONS | CODE_LANGUAGES.keys()
    return [f".{ext}" for ext in sorted(plain)] + gz


def classify(path: str) -> SourceFile | None:
    """The source file for `path` by its extension (case-insensitive), or None if unknown."""
    name = os.path.basename(path).lower()
    stem, dot, ext = name.rpartition(".")
    if not dot or not stem:
        return None
    if ext == "gz":
        inner = stem.rpartition(".")[2] if "." in stem else ""
        return SourceFile(path, "jsonl") if inner in JSONL_EXTENSIONS else None
    if ext in TEXT_EXTENSIONS:
        return SourceFile(path, "text")
    if ext in JSONL_EXTENSIONS:
        return SourceFile(path, "jsonl")
    if ext in PARQUET_EXTENSIONS:
        return SourceFile(path, "parquet")
    if ext in CODE_LANGUAGES:
        return SourceFile(path, "code", CODE_LANGUAGES[ext])
    return None


def unknown_extension(source: str) -> SourceError:
    return SourceError(
        f"source {source} has an unknown extension: rename it to one of "
        f"{', '.join(known_extensions())} or remove it from data.sources"
    )


class WalkTooLong(Exception):
    """An expansion listed more directory entries than its budget allows (not a SourceError:
    the patterns may well be right, there is only too much to look at)."""


class WalkBudget:
    """How far one expansion may look, for a caller that walks for someone else (the API's check
    of a submitted spec): at most `entries` directory entries listed, over every pattern, and only
    files that `admits` (their path as walked) count as found; the others are as if absent, and
    are never named."""

    def __init__(self, entries: int, admits: Callable[[str], bool]) -> None:
        self.left, self.admits = entries, admits

    def spend(self, listed: int) -> None:
        self.left -= listed
        if self.left < 0:
            raise WalkTooLong("the data sources name more entries than this check looks at")


def expand_sources(patterns: list[str], budget: WalkBudget | None = None) -> list[SourceFile]:
    """Every readable file the patterns name, deduplicated and sorted by path; within `budget`
    when one is given (none: the data workers walk everything)."""
    found: dict[str, SourceFile] = {}
    for pattern in patterns:
        for source in _expand_one(pattern, budget):
            found[source.path] = source
    return sorted(found.values())


@dataclass
class Matches:
    files: list[SourceFile] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # files with unknown extensions
    budget: WalkBudget | None = None

    def take(self, path: str) -> None:
        if self.budget is not None and not self.budget.admits(path):
            return
        source = classify(path)
        if source is None:
            self.skipped.append(path)
        else:
            self.files.append(source)

    def nothing_error(self, pattern: str, what: str = "files") -> SourceError:
        hint = ""
        if self.skipped:
            hint = (
                f" ({len(self.skipped)} {what} with unknown extensions were skipped, e.g. "
                f"{min(self.skipped)}; known extensions: {', '.join(known_extensions())})"
            )
        return SourceError(f"source pattern {pattern} matches no {what}{hint}: check data.sources")


def _expand_one(pattern: str, budget: WalkBudget | None) -> list[SourceFile]:
    if not os.path.isabs(pattern):
        raise SourceError(
            f"source pattern {pattern!r} is not an absolute path: resolve it against the "
            "spec file's folder before expanding data.sources"
        )
    pattern = os.path.normpath(pattern)
    matches = Matches(budget=budget)
    # An existing path wins over glob syntax, so a file literally named "a[1].txt" still works.
    if os.path.isfile(pattern):
        source = classify(pattern)
        if source is None:
            raise unknown_extension(pattern)
        return [source]
    if os.path.isdir(pattern):
        _walk(pattern, matches)
    elif GLOB_MAGIC.search(pattern):
        parts = PurePath(pattern).parts
        _glob(parts[0], parts[1:], matches)
    elif os.path.islink(pattern):
        raise SourceError(
            f"source {pattern} is a symbolic link to nothing (broken, or a loop of links): "
            "check data.sources"
        )
    else:
        raise SourceError(f"source {pattern} does not exist: check data.sources")
    if not matches.files:
        raise matches.nothing_error(pattern)
    return matches.files


def _entries(directory: str, matches: Matches) -> list[os.DirEntry[str]]:
    found: list[os.DirEntry[str]] = []
    try:
        with os.scandir(directory) as it:
            for entry in it:  # one by one: a budget stops inside a huge folder, not after it
                if matches.budget is not None:
                    matches.budget.spend(1)
                found.append(entry)
    except OSError as err:
        raise SourceError(
            f"source folder {directory} cannot be listed ({err.strerror}): fix its permissions "
            "or remove it from data.sources"
        ) from None
    return found


def _is_real_dir(entry: os.DirEntry[str]) -> bool:
    # Directory symlinks are not followed: a link back up the tree would walk forever.
    return entry.is_dir(follow_symlinks=False)


def _is_file(entry: os.DirEntry[str]) -> bool:
    """A regular file, following file symlinks. A broken link or a loop of links names no file
    (DirEntry.is_file says False for the first and raises ELOOP for the second)."""
    try:
        return entry.is_file()
    except OSError:
        return False


def _walk(root: str, matches: Matches) -> None:
    stack = [root]
    while stack:
        for entry in _entries(stack.pop(), matches):
            if entry.name.startswith(".") or entry.name in _SKIPPED_NAMES:
                continue
            if _is_real_dir(entry):
                stack.append(entry.path)
            elif _is_file(entry):
                matches.take(entry.path)


def _glob(base: str, parts: tuple[str, ...], matches: Matches) -> None:
    """Match path components one at a time, pruning directories that cannot match."""
    if not parts:
        if os.path.isdir(base):
            _walk(base, matches)
        elif os.path.isfile(base):
            matches.take(base)
        return
    head, rest = parts[0], parts[1:]
    if head == "**":
        if not rest:  # "dir/**" is everything below dir
            if os.path.isdir(base):
                _walk(base, matches)
            return
        _glob(base, rest, matches)  # "**" as zero folders
        if os.path.isdir(base):
            for entry in _entries(base, matches):
                if visible(entry.name, "*") and _is_real_dir(entry):
                    _glob(entry.path, parts, matches)
        return
    if not GLOB_MAGIC.search(head):
        child = os.path.join(base, head)
        if not rest or os.path.isdir(child):
            _glob(child, rest, matches)
        return
    if not os.path.isdir(base):
        return
    for entry in _entries(base, matches):
        if not (visible(entry.name, head) and fnmatch.fnmatchcase(entry.name, head)):
            continue
        if _is_real_dir(entry):
            _glob(entry.path, rest, matches)
        elif not rest and _is_file(entry):
            matches.take(entry.path)


def visible(name: str, component: str) -> bool:
    """Wildcards skip hidden and tool folders unless the pattern itself names a hidden entry."""
    if name.startswith("."):
        return component.startswith(".")
    return name not in _SKIPPED_NAMES
