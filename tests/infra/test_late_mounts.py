"""Binds added to a running box (infra.late_mounts): a box made as the standby's, with a job's
binds added late, shows what a box started with them shows, read-only where it must be, and
nothing else of the host."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import stat
import subprocess
import sys
import textwrap
import time
from dataclasses import asdict
from pathlib import Path

import pytest

from infra import sandbox
from infra.late_mounts import NOT_PERMITTED, LateMountError, add_binds
from infra.sandbox import Box, Mount, python_paths
from trainer.torchrun_process import in_box

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bwrap (bubblewrap)")

# Waits for a line, then says what it sees: what it may read, where it may write.
LOOK = textwrap.dedent(
    """
    import json, os, sys
    paths = json.loads(sys.stdin.readline())
    seen = {}
    for path in paths:
        try:
            read = open(path).read() if os.path.isfile(path) else sorted(os.listdir(path))
        except OSError as err:
            read = type(err).__name__
        target = path if os.path.isfile(path) else os.path.join(path, "written-by-the-box")
        try:
            with open(target, "a") as out:
                out.write("")
            wrote = "written"
        except OSError as err:
            wrote = type(err).__name__
        seen[path] = [read, wrote]
    print(json.dumps(seen))
    """
)


@pytest.fixture
def host(tmp_path: Path) -> dict[str, Path]:
    """A run's folder, its read-only inputs (one inside the run's folder), a door's folder, and
    another run's folder beside it."""
    paths = {
        "run": tmp_path / "node" / "runs" / "r1",
        "other run": tmp_path / "node" / "runs" / "r2",
        "inputs": tmp_path / "cache" / "datasets" / "d1",
        "fallback": tmp_path / "node" / "runs" / "r1" / "fallback",
        "door": tmp_path / "door-r1",
    }
    for name, folder in paths.items():
        folder.mkdir(parents=True)
        (folder / "file.txt").write_text(name)
    paths["shard"] = paths["inputs"] / "file.txt"
    return paths


def job_box(host: dict[str, Path]) -> Box:
    return Box(
        read_only=(*python_paths(), str(host["shard"]), str(host["fallback"])),
        writable=(str(host["run"]),),
        mapped=((str(host["door"]), "/run/forgeline"),),
    )


def inside(bwrap: subprocess.Popen) -> int:
    """The process bwrap runs in its box (bwrap → the box's init → it), once it is there."""
    deadline = time.monotonic() + 10
    while (found := in_box(bwrap.pid)) is None:
        assert time.monotonic() < deadline, "the box did not start"
        time.sleep(0.01)
    return found


def look(box: Box, host: dict[str, Path], before_looking: list[Mount] | None = None) -> dict:
    """Start LOOK in `box`; add `before_looking` to its box while it waits; what it saw. What
    it wrote is removed on the host, for the next look."""
    wanted = ["/run/forgeline", *sorted(str(p) for p in host.values())]
    seen = run_in(box, LOOK, json.dumps(wanted), before_looking)
    for written in (host["run"].parent.parent.parent).rglob("written-by-the-box"):
        written.unlink()
    return seen


def run_in(box: Box, script: str, line: str, before_looking: list[Mount] | None) -> dict:
    """Start `script` in `box`; add `before_looking` to its box while it waits for `line`;
    the JSON object it prints."""
    proc = subprocess.Popen(
        box.argv([sys.executable, "-c", script]),
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        if before_looking is not None:
            asyncio.run(add_binds(inside(proc), before_looking))
        out, _ = proc.communicate(line + "\n", timeout=30)
    finally:
        proc.kill()
    return json.loads(out)


def test_binds_added_to_a_waiting_box_show_what_a_box_started_with_them_shows(
    host: dict[str, Path],
) -> None:
    base = Box(read_only=python_paths())
    cold = look(job_box(host), host)
    late = look(base, host, job_box(host).beyond(base))
    # What a run's box must show: its folder writable, its inputs read-only (also one inside
    # its writable folder), its door at the box's path, another run's folder not at all.
    assert cold[str(host["run"])] == [["fallback", "file.txt"], "written"]
    assert cold[str(host["fallback"])] == [["file.txt"], "OSError"]  # read-only file system
    assert cold[str(host["shard"])] == ["inputs", "OSError"]
    assert cold["/run/forgeline"][1] == "written"
    assert cold[str(host["other run"])] == ["FileNotFoundError", "FileNotFoundError"]
    assert cold[str(host["inputs"])][0] == ["file.txt"]  # the shard's mount point, alone
    assert late == cold


def test_a_box_is_made_into_another_only_by_adding_binds(tmp_path: Path) -> None:
    base = Box(read_only=(str(tmp_path / "env"),))
    (tmp_path / "env").mkdir()
    (tmp_path / "run").mkdir()
    job = Box(read_only=base.read_only, writable=(str(tmp_path / "run"),))
    assert job.beyond(base) == [Mount(str(tmp_path / "run"), str(tmp_path / "run"), True)]
    assert job.beyond(job) == []
    assert Box(writable=job.writable).beyond(base) is None  # base shows what the job must not
    assert Box(read_only=base.read_only, network=False).beyond(base) is None
    covering = Box(read_only=base.read_only, writable=(str(tmp_path),))
    assert covering.beyond(base) is None  # a bind over base's would hide it


def test_a_helper_that_cannot_bind_says_why() -> None:
    with pytest.raises(LateMountError, match="binds not added to the box of 999999999"):
        asyncio.run(add_binds(999_999_999, [Mount("/usr", "/usr", False)]))


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv (util-linux)")
def test_a_helper_without_the_capabilities_says_it_never_will_bind(tmp_path: Path) -> None:
    """An agent that may not mount (here: root with every capability dropped) learns that it
    never may, and starts its boxed jobs cold from then on (trainer.warm_launch)."""
    box = subprocess.Popen(Box(read_only=python_paths()).argv(["sleep", "30"]))
    try:
        mount = Mount(str(tmp_path), str(tmp_path), writable=True)
        helper = subprocess.run(
            ["setpriv", "--bounding-set=-all", sys.executable, "-m", "infra.late_mounts",
             str(inside(box))],
            input=json.dumps(asdict(mount)) + "\n", capture_output=True, text=True, timeout=30,
        )  # fmt: skip
    finally:
        box.kill()
    assert helper.returncode == NOT_PERMITTED, helper.stderr
    assert f"copying the mount of {tmp_path}: Operation not permitted" in helper.stderr


# Lists the GPU files the box shows, and whether each is usable as a device.
LIST_GPUS = textwrap.dedent(
    """
    import json, os, sys
    sys.stdin.readline()
    seen = {}
    for name in sorted(os.listdir("/dev")):
        if name.startswith("nvidia"):
            try:
                with open("/dev/" + name, "w") as device:
                    device.write("x")
                seen[name] = "usable"
            except OSError as err:
                seen[name] = type(err).__name__
    print(json.dumps(seen))
    """
)


@pytest.fixture
def eight_gpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Stand-ins for an 8-GPU node's device files: character devices that behave as /dev/null,
    in a folder of their own that boxes take for the host's /dev."""
    root = tmp_path / "dev"
    root.mkdir()
    for name in [*(f"nvidia{i}" for i in range(8)), "nvidiactl", "nvidia-uvm"]:
        os.mknod(root / name, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    monkeypatch.setattr(sandbox, "DEVICE_ROOT", str(root))
    return root


def gpus_seen(box: Box, before_looking: list[Mount] | None = None) -> dict[str, str]:
    return run_in(box, LIST_GPUS, "go", before_looking)


def test_a_box_shows_its_job_s_gpus_alone_whether_started_with_them_or_given_them_late(
    eight_gpus: Path,
) -> None:
    """Two jobs packed on one 8-GPU node: each box shows its own four GPUs and the files every
    GPU process needs, usable as devices; a standby's box shows no GPU of its own until its
    job's are added."""
    shared = {"nvidia-uvm": "usable", "nvidiactl": "usable"}
    first = Box(read_only=python_paths(), gpus=(0, 1, 2, 3))
    second = Box(read_only=python_paths(), gpus=(4, 5, 6, 7))
    standby = Box(read_only=python_paths(), gpus=())
    assert gpus_seen(first) == {**shared, **{f"nvidia{i}": "usable" for i in range(4)}}
    assert gpus_seen(second) == {**shared, **{f"nvidia{i}": "usable" for i in range(4, 8)}}
    assert gpus_seen(standby) == shared
    added = second.beyond(standby)
    assert added is not None and {m.path for m in added} == {f"/dev/nvidia{i}" for i in range(4, 8)}
    assert gpus_seen(standby, added) == gpus_seen(second)
    assert gpus_seen(Box(read_only=python_paths())) == {
        **shared, **{f"nvidia{i}": "usable" for i in range(8)}
    }  # fmt: skip
