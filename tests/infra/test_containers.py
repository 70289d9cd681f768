"""A job's container (infra.containers, trainer/container_init.py): what podman is told, and
that nothing inside outlives the agent. The container run itself is tests/e2e/test_image.py
(slow: it builds an image)."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

from infra.containers import (
    INIT_SCRIPT,
    LIFELINE_FD,
    NODE_PACKAGES_VARIABLE,
    ContainerBox,
    container_environment,
    ulimits,
)
from infra.sandbox import Box
from trainer.rank_box import box_environment


def test_podman_is_told_the_box_s_paths_and_the_names_of_the_variables_not_their_values(
    tmp_path: Path,
) -> None:
    code, run = tmp_path / "code", tmp_path / "run"
    code.mkdir()
    run.mkdir()
    box = ContainerBox("localhost/lab/trainer:1", Box(read_only=(str(code),),
                       writable=(str(run),)), node="n1").named()  # fmt: skip
    env = {"RANK": "0", "SECRETISH": "value-never-on-the-command-line"}
    argv = box.argv(["python3", "-m", "torch.distributed.run", "x.py"], str(run), sorted(env))

    assert argv[:2] == ["podman", "run"] and "--rm" in argv
    assert f"{code}:{code}:ro" in argv and f"{run}:{run}:rw" in argv
    assert "value-never-on-the-command-line" not in " ".join(argv)
    assert argv[argv.index("--env", argv.index("RANK") - 1) + 1] == "RANK"
    # No capability, no new privileges, the image's root read-only, its own namespaces.
    for flag, value in (("--cap-drop", "all"), ("--security-opt", "no-new-privileges"),
                        ("--ipc", "private"), ("--label", "forgeline.node=n1")):  # fmt: skip
        assert argv[argv.index(flag) + 1] == value, flag
    assert "--read-only" in argv and "--privileged" not in argv and "--pid" not in argv
    # The image's python3 runs the init, which runs the command.
    image_at = argv.index("localhost/lab/trainer:1")
    assert argv[image_at + 1 :] == [str(INIT_SCRIPT), str(LIFELINE_FD), "--", "python3", "-m",
                                   "torch.distributed.run", "x.py"]  # fmt: skip
    assert argv[argv.index("--entrypoint") + 1] == "python3"


def test_a_rank_s_environment_in_an_image_keeps_no_node_python_and_no_store_credential() -> None:
    env = {"PATH": "/node/venv/bin", "VIRTUAL_ENV": "/node/venv", "RANK": "1",
           "AWS_SECRET_ACCESS_KEY": "k", "LD_LIBRARY_PATH": "/node/lib"}  # fmt: skip
    inside = container_environment(box_environment(env))
    assert inside["RANK"] == "1"
    assert not {"PATH", "VIRTUAL_ENV", "LD_LIBRARY_PATH", "AWS_SECRET_ACCESS_KEY"} & set(inside)
    assert inside["PYTHONPATH"].endswith("trainer/container_site")
    folders = inside[NODE_PACKAGES_VARIABLE].split(os.pathsep)
    assert any(Path(f, "temporalio").is_dir() or Path(f).name == "site-packages" for f in folders)


def test_the_container_is_held_to_the_agent_s_own_limits() -> None:
    limits = ulimits()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert limits[:2] == ["--ulimit", f"nofile={soft}:{hard}"]
    nproc = limits[3].removeprefix("nproc=").split(":")
    assert all(0 < int(n) <= 32768 for n in nproc), limits


def _init(tmp_path: Path, *command: str) -> tuple[subprocess.Popen, int]:
    """container_init.py as podman starts it: the lifeline's read end at LIFELINE_FD."""
    read_end, write_end = os.pipe()

    def at_fd_3() -> None:
        os.dup2(read_end, LIFELINE_FD)

    init = subprocess.Popen(
        [sys.executable, str(INIT_SCRIPT), str(LIFELINE_FD), "--", *command],
        pass_fds=(LIFELINE_FD,),
        preexec_fn=at_fd_3,
        cwd=tmp_path,
    )
    os.close(read_end)
    return init, write_end


def _child_of(pid: int, timeout: float = 10.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        if kids:
            return int(kids[0])
        time.sleep(0.02)
    raise AssertionError("the init started nothing")


def _gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[0]
        except OSError:
            return True
        if state == "Z":
            return True
        time.sleep(0.02)
    return False


def test_the_agent_s_death_closes_the_lifeline_and_ends_what_runs_inside(tmp_path: Path) -> None:
    init, lifeline = _init(tmp_path, "sleep", "300")
    child = _child_of(init.pid)
    time.sleep(0.3)
    assert init.poll() is None and not _gone(child, timeout=0.1)
    os.close(lifeline)  # what the kernel does to the agent's descriptors when it dies
    assert init.wait(timeout=10) == 137
    assert _gone(child), "the command outlived the agent"


def test_the_init_exits_with_the_command_s_status_and_passes_on_a_sigterm(
    tmp_path: Path,
) -> None:
    init, lifeline = _init(tmp_path, sys.executable, "-c", "raise SystemExit(3)")
    try:
        assert init.wait(timeout=30) == 3
    finally:
        os.close(lifeline)
    init, lifeline = _init(tmp_path, "sleep", "300")
    try:
        _child_of(init.pid)
        init.send_signal(signal.SIGTERM)
        assert init.wait(timeout=10) == 128 + signal.SIGTERM
    finally:
        os.close(lifeline)
