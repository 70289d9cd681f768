"""A code folder's own Python environment, built with uv once per node and shared read-only.

A run whose code folder declares requirements (infra.requirements: a `requirements.txt`, or a
`pyproject.toml` with its `uv.lock`) runs its ranks with the interpreter of an environment made
for them. Everything else comes from the node: a `.pth` file in the environment adds the node's
site-packages after the environment's own, so torch, Forgeline and their packages are the
node's, and whatever the environment installed itself wins over the node's copy. torch is
excluded from the resolution unless the user asks for another than the node's: a library that
merely depends on torch must never bring a second, multi-GB torch that shadows the node's build
for its GPUs.

One environment per key: the digest of what was declared (the lock, when there is one), the
node's Python and torch, and the node's site-packages the `.pth` names. It is built in a
temporary folder and renamed into place with its record written last, so a half-built one is
never used; a file lock makes two builds of one key (two runs on one node) build once. The node
cache (activities.fetch) keeps environments under its byte budget, like its other entries.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.metadata
import json
import os
import platform
import shutil
import site
import subprocess
import sys
import sysconfig
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any, ClassVar

import uv
from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

from infra.digest import sha256_bytes
from infra.requirements import DeclaredEnvironment, DeclaredKind, node_serves
from infra.stored_format import StoredFormatError, StoredRecord

# The environment's record, written last: an environment without it is not one.
RECORD_FILE = "forgeline-env.json"
NODE_PTH = "_forgeline_node.pth"
# How the environment is made: a change to it gives every environment a new key.
BUILD_FORMAT = 1
# uv's own words are kept to this many characters: enough for a resolver's explanation.
MESSAGE_CHARS = 600


class EnvironmentBuildFailed(Exception):
    """The code folder's requirements cannot be installed: the user's to fix; one line, with
    what uv said."""


@dataclass(frozen=True)
class NodePython:
    """What an environment is built on: this node agent's interpreter and its packages."""

    executable: str
    version: str
    torch: str
    site_dirs: tuple[str, ...]

    @staticmethod
    @cache
    def this() -> NodePython:
        return NodePython(
            executable=sys.executable,
            version=platform.python_version(),
            torch=importlib.metadata.version("torch"),
            site_dirs=tuple(site.getsitepackages()),
        )


class EnvRecord(StoredRecord):
    """What an environment was built from, in the environment's folder."""

    VERSIONS: ClassVar[tuple[Any, ...]] = (1,)
    WHAT: ClassVar[str] = "Python environment record"

    format: int = 1
    key: str
    declared: str  # the file it was built from, as named in the code folder
    declared_sha256: str
    python: str
    torch: str
    uv: str
    build_s: float


@dataclass(frozen=True)
class UserEnv:
    """A built environment: its folder, read-only for every run that uses it."""

    folder: Path

    @property
    def python(self) -> Path:
        return self.folder / "bin" / "python"

    def variables(self, env: dict[str, str]) -> dict[str, str]:
        """What a rank's environment says about it: a script's subprocesses find its Python
        and its packages' commands first."""
        path = env.get("PATH", os.defpath)
        return {"VIRTUAL_ENV": str(self.folder), "PATH": f"{self.folder / 'bin'}:{path}"}


def environment_key(wanted: DeclaredEnvironment, node: NodePython) -> str:
    """The name of the environment `wanted` becomes on `node`."""
    inputs = {
        "format": BUILD_FORMAT,
        "declared": wanted.kind.value,
        "sha256": wanted.sha256,
        "python": node.version,
        "torch": node.torch,
        "site_dirs": node.site_dirs,
    }
    return sha256_bytes(json.dumps(inputs, sort_keys=True).encode())


def ensure(wanted: DeclaredEnvironment, folder: Path, node: NodePython) -> UserEnv:
    """The environment at `folder` (named by `environment_key`): used as it is when it was
    built whole, else built now; builds of one folder wait for each other."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    with _build_lock(folder):
        if built(folder) is not None:
            return UserEnv(folder)
        shutil.rmtree(folder, ignore_errors=True)  # a record of another build or none
        building = folder.with_name(f".building-{folder.name}-{uuid.uuid4().hex[:8]}")
        try:
            _build(wanted, building, node, folder.name)
            os.rename(building, folder)
        finally:
            shutil.rmtree(building, ignore_errors=True)
    return UserEnv(folder)


def built(folder: Path) -> EnvRecord | None:
    """The record of the environment built whole at `folder`; None when there is none."""
    record = folder / RECORD_FILE
    try:
        found = EnvRecord.parse(record.read_bytes(), str(record))
    except (OSError, StoredFormatError):
        return None
    return found if found.key == folder.name else None


@contextlib.contextmanager
def _build_lock(folder: Path) -> Iterator[None]:
    # flock: another thread's descriptor of the same file waits too, and a crashed build's
    # lock goes with its process.
    with open(folder.with_name(f".{folder.name}.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _build(wanted: DeclaredEnvironment, folder: Path, node: NodePython, key: str) -> None:
    started = time.monotonic()
    code_dir = wanted.file.parent
    _uv("venv", "--relocatable", "--no-project", "--python", node.executable, str(folder),
        cwd=code_dir)  # fmt: skip
    own = Path(sysconfig.get_path("purelib", vars={"base": folder, "platbase": folder}))
    # After the environment's own site-packages, whose packages therefore win; addsitedir, not
    # a plain path line, so that the node's own .pth files (an editable Forgeline) count too.
    (own / NODE_PTH).write_text(
        "".join(f"import site; site.addsitedir({d!r})\n" for d in node.site_dirs)
    )
    with tempfile.TemporaryDirectory(dir=folder.parent, prefix=".uv-") as scratch:
        requirements = _requirements_file(wanted, Path(scratch))
        excluded = Path(scratch) / "excluded.txt"
        torch_from_node = node_serves(wanted, "torch", node.torch)
        excluded.write_text("torch\n" if torch_from_node else "")
        _uv(
            "pip", "install", "--python", str(folder / "bin" / "python"),
            "-r", str(requirements), "--excludes", str(excluded),
            # Copies, not links into uv's cache: the environment's bytes are its own, as the
            # node cache counts them, and pruning uv's cache never breaks it.
            "--link-mode", "copy",
            # Wheels only: building a source distribution runs its code here, as the agent,
            # outside the box the ranks run in.
            "--no-build",
            cwd=code_dir,
        )  # fmt: skip
    if torch_from_node:
        _check_torch_needs(own, node.torch)
    record = EnvRecord(
        key=key,
        declared=wanted.file.name,
        declared_sha256=wanted.sha256,
        python=node.version,
        torch=node.torch,
        uv=importlib.metadata.version("uv"),
        build_s=round(time.monotonic() - started, 3),
    )
    (folder / RECORD_FILE).write_bytes(record.dump_bytes())


def _requirements_file(wanted: DeclaredEnvironment, scratch: Path) -> Path:
    """What uv installs: the requirements.txt itself, or the lock's exact versions."""
    if wanted.kind is DeclaredKind.REQUIREMENTS:
        return wanted.file
    exported = scratch / "locked.txt"
    _uv("export", "--frozen", "--no-emit-project", "--format", "requirements-txt",
        "--output-file", str(exported), cwd=wanted.file.parent)  # fmt: skip
    return exported


def _check_torch_needs(site_packages: Path, node_torch: str) -> None:
    """Torch left out of the resolution, what the environment installed must still work with
    the node's: a package pinned to another torch (a torchvision of another release) is said
    now, not as an undefined symbol in every rank."""
    problems = []
    for dist in importlib.metadata.distributions(path=[str(site_packages)]):
        for line in dist.requires or []:
            with contextlib.suppress(InvalidRequirement):
                need = Requirement(line)
                applies = need.marker is None or need.marker.evaluate({"extra": ""})
                if canonicalize_name(need.name) == "torch" and applies and need.specifier \
                        and not need.specifier.contains(node_torch, prereleases=True):  # fmt: skip
                    problems.append(f"{dist.name} {dist.version} needs {need}")
    if problems:
        raise EnvironmentBuildFailed(
            f"{'; '.join(problems)}, but this node's torch is {node_torch}: pin a release made "
            "for it, or name torch in the requirements to install another"
        )


def _uv(*args: str, cwd: Path | None = None) -> None:
    """Run uv; EnvironmentBuildFailed with what it said when it fails."""
    done = subprocess.run(
        [uv.find_uv_bin(), "--color", "never", "--no-progress", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        command = " ".join(args[:2] if args[0] == "pip" else args[:1])
        raise EnvironmentBuildFailed(f"uv {command}: {uv_says(done.stderr or done.stdout)}")


def uv_says(output: str) -> str:
    """uv's error in one line: from its `error:` (or its drawn `×`) on, without the drawing,
    its wrapped lines joined, trimmed."""
    lines = output.splitlines()
    start = next(
        (i for i, line in enumerate(lines) if line.lstrip().startswith(("error:", "×"))), 0
    )
    words = (line.strip(" ×╰─▶│") for line in lines[start:])
    said = " ".join(word for word in words if word).removeprefix("error: ")
    return said if len(said) <= MESSAGE_CHARS else said[: MESSAGE_CHARS - 1] + "…"
