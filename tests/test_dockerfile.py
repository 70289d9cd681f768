"""The Dockerfile, checked without a Docker engine (there is none here or in CI, so the image
is never built by the tests): what it copies exists and makes the whole wheel, the extras it
names are pyproject's, torch goes in before the wheel, and what it runs is the CLI, as a
non-root user the Kubernetes manifests also name."""

from __future__ import annotations

import fnmatch
import json
import re
import tomllib
from importlib import metadata

import yaml
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from tests.conftest import REPO
from tests.forgeline_argv import check_forgeline_argv
from tests.test_packaging import PACKAGES

DOCKERFILE = REPO / "Dockerfile"
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order: continuation lines joined, comments dropped."""
    logical, pending = [], ""
    for line in DOCKERFILE.read_text().splitlines():
        if line.lstrip().startswith("#") or not line.strip():
            continue
        pending += line.rstrip().removesuffix("\\") + " "
        if not line.rstrip().endswith("\\"):
            logical.append(pending.strip())
            pending = ""
    return [(text.split(None, 1)[0].upper(), text.split(None, 1)[1]) for text in logical]


INSTRUCTIONS = instructions()


def arguments(name: str) -> list[str]:
    return [args for instruction, args in INSTRUCTIONS if instruction == name]


def test_every_copied_source_exists_and_together_they_make_the_whole_wheel() -> None:
    copied = []
    for args in arguments("COPY"):
        if args.startswith("--from="):
            continue
        *sources, _dest = args.split()
        copied += [source.rstrip("/") for source in sources]
    assert [s for s in copied if not (REPO / s).exists()] == []
    assert set(PACKAGES) | {"pyproject.toml", "README.md"} == set(copied)
    # ...and none of them is left out of the build context.
    ignored = [line for line in (REPO / ".dockerignore").read_text().splitlines()
               if line and not line.startswith("#")]  # fmt: skip
    assert [s for s in copied if any(fnmatch.fnmatch(s, pattern) for pattern in ignored)] == []
    assert ".venv" in ignored  # gigabytes


def test_torch_goes_in_first_from_its_own_index_in_a_version_pyproject_allows() -> None:
    runs = arguments("RUN")
    torch_at = next(i for i, r in enumerate(runs) if '"torch==${TORCH_VERSION}"' in r)
    wheel_at = next(i for i, r in enumerate(runs) if "forgeline-*.whl" in r and "install" in r)
    assert torch_at < wheel_at and "--index-url" in runs[torch_at]
    defaults = dict(a.split("=", 1) for a in arguments("ARG") if "=" in a)
    (torch,) = [
        Requirement(r) for r in PYPROJECT["project"]["dependencies"] if r.startswith("torch")
    ]
    assert defaults["TORCH_VERSION"] in SpecifierSet(str(torch.specifier))
    # The version every other install here pins (Makefile, .ci/run, tests/fresh_env.py).
    assert defaults["TORCH_VERSION"] == metadata.version("torch").split("+")[0]
    assert defaults["PYTHON_IMAGE"] == "python:3.11-slim"
    assert defaults["FORGELINE_EXTRA"] == ""  # an agent's image: the base install


def test_the_extras_it_names_are_pyproject_s() -> None:
    named = re.findall(r"FORGELINE_EXTRA=(\w+)", DOCKERFILE.read_text())
    for path in (REPO / "infra" / "deploy" / "kubernetes").glob("*.yaml"):
        named += re.findall(r"FORGELINE_EXTRA=(\w+)", path.read_text())
    assert {"control", "data"} <= set(named)
    assert set(named) <= set(PYPROJECT["project"]["optional-dependencies"])


def test_it_runs_the_cli_as_a_non_root_user_with_the_state_folder_on_a_volume() -> None:
    (entrypoint,) = arguments("ENTRYPOINT")
    (cmd,) = arguments("CMD")
    assert json.loads(entrypoint) == ["forgeline"]
    assert "forgeline" in PYPROJECT["project"]["scripts"]
    check_forgeline_argv(json.loads(cmd))
    (user,) = arguments("USER")
    uid, gid = (int(x) for x in user.split(":"))
    assert uid != 0
    (volume,) = arguments("VOLUME")
    env = " ".join(arguments("ENV"))
    assert f"FORGELINE_HOME={json.loads(volume)[0]}" in env
    # The manifests run the images as that same user.
    for path in (REPO / "infra" / "deploy" / "kubernetes").glob("*.yaml"):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc["kind"] in ("DaemonSet", "Deployment"):
                context = doc["spec"]["template"]["spec"]["securityContext"]
                assert (context["runAsUser"], context["runAsGroup"]) == (uid, gid), path.name


def test_the_image_holds_the_box_and_the_compiler_a_gpu_run_needs() -> None:
    """bwrap boxes every job's ranks; Triton needs a C compiler and headers at the first
    torch.compile on a GPU, and python:3.11-slim has neither."""
    installs = [r for r in arguments("RUN") if "apt-get install" in r]
    packages = {word for run in installs for word in run.split() if not word.startswith("-")}
    assert {"bubblewrap", "gcc", "libc6-dev"} <= packages
