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
