"""A code folder's requirements become a Python environment built with uv once per node (issue
46, part 4): a package the node lacks is installed once and reused; a bad pin fails at once with
uv's own words; two pins of one package each see their own; torch is the node's, never one a
dependency brings. Real uv against the package index (its cache makes a second build cheap), in
a real NodeCache."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch
import uv

from activities.fetch import NodeCache
from infra.requirements import declared_environment, node_serves
from infra.store.local import LocalStore
from infra.user_envs import RECORD_FILE, EnvironmentBuildFailed, UserEnv, built, uv_says

# Small, pure Python, and not installed with Forgeline.
PACKAGE = "tomli-w"
MODULE = "tomli_w"


def code_folder(root: Path, requirements: str) -> Path:
    folder = root / f"code-{abs(hash(requirements))}"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "requirements.txt").write_text(requirements)
    return folder


def node_cache(root: Path, budget_bytes: int = 10**10) -> NodeCache:
    return NodeCache(root / "cache", LocalStore(root / "store"), budget_bytes)


def environment(cache: NodeCache, code: Path) -> UserEnv:
    with cache.lease() as lease:
        env = lease.environment(code)
    assert env is not None
    return env


def inside(env: UserEnv, source: str) -> dict:
    """What `source` prints (one JSON line) when run by the environment's Python."""
    done = subprocess.run(
        [str(env.python), "-c", source], capture_output=True, text=True, check=True, timeout=120
    )
    return json.loads(done.stdout)


SEEN = """
import importlib.metadata, json, tomli_w, torch
print(json.dumps({"version": importlib.metadata.version("tomli-w"), "module": tomli_w.__file__,
                  "torch": torch.__file__, "torch_version": torch.__version__}))
"""


def test_the_node_lacks_the_package() -> None:
    # What the tests below install must be new to the node, or they would prove nothing.
    assert importlib.util.find_spec(MODULE) is None


def test_a_package_the_node_lacks_is_built_once_and_reused(tmp_path: Path) -> None:
    cache = node_cache(tmp_path)
    code = code_folder(tmp_path, f"{PACKAGE}==1.0.0\n")
    started = time.monotonic()
    env = environment(cache, code)
    first_s = time.monotonic() - started
    record = (env.folder / RECORD_FILE).stat()

    seen = inside(env, SEEN)
    assert seen["version"] == "1.0.0"
    assert seen["module"].startswith(str(env.folder))
    # torch is the node's own, the same build, not a copy in the environment.
    assert seen["torch"] == torch.__file__
    assert seen["torch_version"] == torch.__version__

    # Another run with the same requirements (another code folder, same bytes): no build.
    started = time.monotonic()
    again = environment(cache, code_folder(tmp_path / "other-run", f"{PACKAGE}==1.0.0\n"))
    reuse_s = time.monotonic() - started
    assert again.folder == env.folder
    assert (env.folder / RECORD_FILE).stat().st_ino == record.st_ino  # not built again
    assert reuse_s < 0.5, (first_s, reuse_s)
    assert cache.budget.entry(f"envs/{env.folder.name}").bytes > 0
    print(f"first build {first_s:.2f} s, reuse {reuse_s * 1000:.1f} ms")


def test_no_requirements_no_environment(tmp_path: Path) -> None:
    """Nothing declared, or only what the node has (the examples' `torch>=2.6`): the node's
    interpreter serves, as before, with its warm standby."""
    with node_cache(tmp_path).lease() as lease:
        assert lease.environment(tmp_path) is None
        assert lease.environment(code_folder(tmp_path, "torch>=2.6\nnumpy\n")) is None
    assert not (tmp_path / "cache" / "envs").exists()


@pytest.mark.parametrize(
    ("requirement", "said"),
    [
        ("six==999", r"there is no version of six==999"),
        ("thispackagedoesnotexist==1.0", r"thispackagedoesnotexist was not found in the package"),
    ],
)
def test_a_bad_pin_fails_at_once_with_uv_s_message(
    tmp_path: Path, requirement: str, said: str
) -> None:
    cache = node_cache(tmp_path)
    started = time.monotonic()
    with pytest.raises(EnvironmentBuildFailed, match=said) as failed:
        environment(cache, code_folder(tmp_path, f"{requirement}\n"))
    assert time.monotonic() - started < 30
    message = str(failed.value)
    assert "\n" not in message and message.startswith("uv pip install: No solution found")
    # Nothing half-built is left to be taken for an environment, nor counted.
    assert [p.name for p in (tmp_path / "cache" / "envs").iterdir() if p.is_dir()] == []
    assert cache.budget.used_bytes() == 0


def test_uv_s_message_is_one_line_without_its_drawing() -> None:
    fancy = (
        "Using Python 3.11.7 environment at: env\n"
        "  × No solution found when resolving dependencies:\n"
        "  ╰─▶ Because there is no version of six==999 and you require six==999, we can\n"
        "      conclude that your requirements are unsatisfiable.\n"
    )
    assert uv_says(fancy) == (
        "No solution found when resolving dependencies: Because there is no version of "
        "six==999 and you require six==999, we can conclude that your requirements are "
        "unsatisfiable."
    )
    plain = "Using Python\nerror: No solution found\n  cause: Because x\n"
    assert uv_says(plain) == "No solution found cause: Because x"
    assert len(uv_says("error: " + "x" * 5000)) == 600


def test_two_pins_of_one_package_each_see_their_own(tmp_path: Path) -> None:
    cache = node_cache(tmp_path)
    old = environment(cache, code_folder(tmp_path, f"{PACKAGE}==1.0.0\n"))
    new = environment(cache, code_folder(tmp_path, f"{PACKAGE}==1.1.0\n"))
    assert old.folder != new.folder
    assert inside(old, SEEN)["version"] == "1.0.0"
    assert inside(new, SEEN)["version"] == "1.1.0"


def test_two_builds_of_one_environment_at_once_build_it_once(tmp_path: Path) -> None:
    cache = node_cache(tmp_path)
    code = code_folder(tmp_path, f"{PACKAGE}==1.0.0\n")
    records: list[int] = []

    def run() -> None:
        env = environment(cache, code)
        records.append((env.folder / RECORD_FILE).stat().st_ino)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    (folder,) = [p for p in (tmp_path / "cache" / "envs").iterdir() if p.is_dir()]
    # Each saw the one record the first build wrote; a second build would have replaced it.
    assert records == [(folder / RECORD_FILE).stat().st_ino] * 2


def test_torch_is_never_brought_by_a_dependency(tmp_path: Path) -> None:
    """torchmetrics depends on torch: the node's torch serves it, no second torch is installed
    (uv would install a 2.15 CUDA build with its nvidia packages)."""
    env = environment(node_cache(tmp_path), code_folder(tmp_path, "torchmetrics\n"))
    site = env.folder / "lib"
    assert not list(site.glob("python*/site-packages/torch")), "a torch in the environment"
    assert not list(site.glob("python*/site-packages/nvidia*"))
    seen = inside(env, "import json, torch, torchmetrics; print(json.dumps(torch.__file__))")
    assert seen == torch.__file__


def test_a_package_made_for_another_torch_is_said_at_build(tmp_path: Path) -> None:
    """torchvision pins the torch it was built for: excluding torch from the resolution must not
    hide that it will not load with the node's."""
    code = code_folder(tmp_path, "torchvision\n")
    with pytest.raises(
        EnvironmentBuildFailed, match=r"torchvision \S+ needs torch[=<>~]"
    ) as failed:
        environment(node_cache(tmp_path), code)
    assert f"this node's torch is {torch.__version__}" in str(failed.value)


def test_a_locked_project_installs_its_locked_versions(tmp_path: Path) -> None:
    code = tmp_path / "project"
    code.mkdir()
    (code / "pyproject.toml").write_text(
        f'[project]\nname = "mine"\nversion = "0.1.0"\nrequires-python = ">=3.11"\n'
        f'dependencies = ["{PACKAGE}<1.1"]\n'
    )
    subprocess.run([uv.find_uv_bin(), "lock", "--quiet"], cwd=code, check=True, timeout=120)
    wanted = declared_environment(code)
    assert wanted is not None and wanted.file.name == "uv.lock"
    assert inside(environment(node_cache(tmp_path), code), SEEN)["version"] == "1.0.0"


def test_environments_leave_least_recently_used_first_never_one_a_job_holds(
    tmp_path: Path,
) -> None:
    probe = node_cache(tmp_path / "probe")
    environment(probe, code_folder(tmp_path, f"{PACKAGE}\n"))
    cache = node_cache(tmp_path, budget_bytes=int(probe.budget.used_bytes() * 2.5))  # room for 2
    a, b, c, d = (
        code_folder(tmp_path, text)
        for text in (f"{PACKAGE}==1.0.0\n", f"{PACKAGE}==1.1.0\n", f"{PACKAGE}==1.2.0\n",
                     f"{PACKAGE}==1.0.0  # another\n")
    )  # fmt: skip
    env_a, env_b = environment(cache, a), environment(cache, b)
    environment(cache, a)  # used again: b is now the least recently used
    env_c = environment(cache, c)
    assert built(env_b.folder) is None and not env_b.folder.exists()
    assert built(env_a.folder) is not None
    with cache.lease() as running:  # a job runs with a's: c goes, though used after a
        assert running.environment(a) == env_a
        environment(cache, d)
        assert built(env_a.folder) is not None
        assert not env_c.folder.exists()
    leftovers = [p.name for p in (tmp_path / "cache" / "envs").iterdir()]
    assert not [name for name in leftovers if name.startswith((".building", ".evicted"))]


def test_what_a_code_folder_declares(tmp_path: Path) -> None:
    (tmp_path / "requirements.txt").write_text(
        "# comment\nTorch>=2.0\n-r other.txt\nnumpy; python_version < '3.0'\nnot a requirement!!\n"
    )
    wanted = declared_environment(tmp_path)
    assert wanted is not None and wanted.kind.value == "requirements"
    assert [r.name for r in wanted.named] == ["Torch", "numpy"]
    # The node's torch serves a range it is in, not another (a URL, a version it is not).
    assert node_serves(wanted, "torch", torch.__version__)
    assert not node_serves(wanted, "torch", "1.13.0")
    assert node_serves(wanted, "six", "1.0")  # not asked for
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "x"\ndependencies = ["six"]\n')
    assert declared_environment(tmp_path).kind.value == "requirements"  # no lock: not a project
    (tmp_path / "uv.lock").write_text("version = 1\n")
    locked = declared_environment(tmp_path)
    assert locked.file.name == "uv.lock" and [r.name for r in locked.named] == ["six"]
