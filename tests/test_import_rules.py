"""The design's import rules (ARCHITECTURE.md, "What each package owns and may import"),
checked on every module's imports as Python would resolve them (function-level ones too):
workflows stay deterministic and free of I/O, domain packages never import Temporal, infra
imports no other package of the project."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

PROJECT = {"forgeline", "workflows", "activities", "dataprep", "trainer", "registry", "worker",
           "infra"}  # fmt: skip
# The project's packages each may import (its own always).
MAY_IMPORT = {
    "workflows": set(),
    "infra": set(),
    "dataprep": {"infra"},
    # The built-in GPT trainer is one user of the SDK, with no privileges a user script lacks.
    "trainer": {"infra", "forgeline"},
    "registry": {"infra"},
    "activities": {"workflows", "dataprep", "trainer", "registry", "infra"},
}
# Third-party packages a folder must never import, besides the rule above.
NEVER = {
    "workflows": {"torch", "mlflow", "duckdb", "boto3", "botocore", "pyarrow", "datasketch",
                  "requests", "numpy"},
    "dataprep": {"temporalio"},
    "trainer": {"temporalio"},
    "registry": {"temporalio"},
    "infra": {"temporalio"},
}  # fmt: skip
# A workflow does no I/O: it is replayed, and must decide the same every time (Temporal's
# sandbox refuses nondeterminism at run time; this catches the imports before).
IO_MODULES = {"os", "pathlib", "subprocess", "socket", "shutil", "tempfile", "urllib", "io",
              "http"}  # fmt: skip


def imported(path: Path) -> set[str]:
    """Top-level names of everything the module imports, at any depth of its code."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def modules(package: str) -> list[Path]:
    return sorted((REPO / package).rglob("*.py"))


@pytest.mark.parametrize("package", sorted(MAY_IMPORT))
def test_a_package_imports_only_what_the_design_allows(package: str) -> None:
    allowed = MAY_IMPORT[package] | {package}
    broken = [
        f"{path.relative_to(REPO)} imports {name}"
        for path in modules(package)
        for name in sorted(imported(path))
        if (name in PROJECT and name not in allowed) or name in NEVER.get(package, set())
    ]
    assert broken == []


def test_workflows_do_no_io() -> None:
    broken = [
        f"{path.relative_to(REPO)} imports {name}"
        for path in modules("workflows")
        for name in sorted(imported(path) & IO_MODULES)
    ]
    assert broken == []


def test_the_rules_see_what_they_check() -> None:
    """The walk finds imports inside functions too, and the packages are where it looks."""
    assert "temporalio" in imported(REPO / "activities" / "node.py")
    assert all(modules(package) for package in MAY_IMPORT)
    assert "os" in sys.stdlib_module_names


def module_name(path: Path) -> str:
    name = ".".join(path.relative_to(REPO).with_suffix("").parts)
    return name.removesuffix(".__init__")


def project_imports(path: Path, known: set[str]) -> set[str]:
    """The project's modules this one imports when it runs (a name imported from a package
    counts as its module when it is one). Imports under `if TYPE_CHECKING:` never run, so
    they make no circle."""
    tree = ast.parse(path.read_text(), str(path))
    typing_only = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING"
        for inner in ast.walk(node)
    }
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                found.add(submodule if submodule in known else node.module)
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
    return found & known


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    found.append(sorted(group))
    return found


def test_no_module_imports_itself_through_others() -> None:
    """A circle of imports means no module of it can be read, tested or moved alone (the store
    once was: its protocol, local store and factory were one module that the S3 and twin stores
    imported, and that imported them)."""
    paths = {module_name(path): path for package in PROJECT for path in modules(package)}
    graph = {name: project_imports(path, set(paths)) - {name} for name, path in paths.items()}
    assert circles(graph) == []


def test_the_circle_finder_finds_a_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [["a", "b", "c"]]
