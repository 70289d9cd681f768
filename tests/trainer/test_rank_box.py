"""Ranks in a box (trainer.rank_box, infra.sandbox): a hostile script run by real torchrun ranks
looks for the agent's secrets, other runs' files and a way into the next run, and finds none.

The test process plays the node agent: its environment holds a Temporal key, its state folder
an env file, and its node cache another team's checkpoint.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import stat
from pathlib import Path

import pytest

from infra import sandbox
from infra.processes import free_port
from tests.trainer.conftest import Trainer, returns_when_every_rank_wrote
from tests.workflows.scheduling.policy_fixtures import NOW, node, request
from trainer.device_env import GrantedDevices
from trainer.errors import UserCodeFailed
from trainer.launch import Rendezvous, run_ranks
from trainer.rank_box import (
    BOX_DOOR,
    DOOR_SOCKET,
    UNCONFINED_FORM,
    Confinement,
    UnconfinedFormError,
    decide,
    door_url,
    rank_box,
    standby_box,
)
from trainer.store_door import DoorPolicy, StoreDoor, door_folder
from trainer.warm_launch import WarmLauncher
from workflows.contracts.cluster_models import ClusterConfig, ClusterState
from workflows.contracts.spec import TrainSpec
from workflows.scheduling.cluster_ops import run_pass
from workflows.scheduling.policy_switches import TODAY

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bwrap (bubblewrap)")

SECRET = "tk-agent-secret-5f2d"
# The script tries each door and writes what it found where its run may write (its job folder).
HOSTILE = returns_when_every_rank_wrote(
    """
    import json, os, pathlib, sys
    probe = json.loads(pathlib.Path(__file__).with_name("probe.json").read_text())
    found = {"uid": os.getuid(), "pids": [], "secret_in": [], "read": {}, "wrote": {}}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            found["pids"].append(int(entry))
            for part in ("environ", "cmdline"):
                try:
                    if probe["secret"] in open(f"/proc/{entry}/{part}").read():
                        found["secret_in"].append(f"/proc/{entry}/{part}")
                except OSError:
                    pass
    found["env_has_secret"] = any(probe["secret"] in v for v in os.environ.values())
    for path in probe["read"]:
        try:
            found["read"][path] = pathlib.Path(path).read_text()[:40]
        except OSError as err:
            found["read"][path] = type(err).__name__
    for path in probe["write"]:
        try:
            pathlib.Path(path).write_text("import os  # planted")
            found["wrote"][path] = "written"
        except OSError as err:
            found["wrote"][path] = type(err).__name__
    found["tmp"] = os.listdir("/tmp")
    cuda = ("PYTORCH_NVML_BASED_CUDA_CHECK", "CUDA_DEVICE_ORDER", "TORCH_NCCL_DUMP_ON_TIMEOUT",
            "TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")
    found["cuda_env"] = {name: os.environ.get(name) for name in cuda}
    cache = pathlib.Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])
    cache.mkdir(parents=True, exist_ok=True)  # torch.compile's kernels, kept across restarts
    (cache / f"kernel-{os.environ['RANK']}").write_text("compiled")
    from infra.store.door import DoorStore
    door = DoorStore(probe["door"])
    escape = f"escape-{os.environ['RANK']}"  # one a rank: both ranks run this
    pathlib.Path(escape).symlink_to(probe["agent_home"])
    tries = {
        "list all runs": lambda: door.list("runs/"),
        "read theirs": lambda: door.get_bytes(probe["theirs"]),
        "overwrite theirs": lambda: door.put_bytes(probe["theirs"], b"{}"),
        "rewrite its fence": lambda: door.put_bytes(probe["fence"], b"{}"),
        "write another generation": lambda: door.put_bytes(probe["other_gen"], b"{}"),
        "upload the agent's environ": lambda: door.put_file(probe["mine"], "/proc/self/environ"),
        "upload through a link": lambda: door.put_file(probe["mine"], f"{escape}/agent.env"),
        "write its own": lambda: door.put_bytes(probe["mine"], b"mine"),
        "read its own": lambda: door.get_bytes(probe["mine"]).decode(),
    }
    found["door"] = {}
    for name, attempt in tries.items():
        try:
            found["door"][name] = ["ok", attempt()]
        except Exception as err:
            found["door"][name] = [type(err).__name__, str(err)]
    out = pathlib.Path(os.environ["FORGELINE_JOB"]).with_name(f"found-{os.environ['RANK']}.json")
    out.write_text(json.dumps(found))
    """
)


@pytest.mark.parametrize("start", ["cold", "warm"])
def test_a_hostile_script_in_a_box_finds_no_secret_and_writes_nothing_outside_its_run(
    trainer: Trainer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
    caplog: pytest.LogCaptureFixture,
    start: str,
) -> None:
    """Cold: torchrun started in the job's box. Warm: the node's standby torchrun, made in the
    box every job shares before the job was known, becomes the job's once the job's own binds
    are added to its box (infra.late_mounts): the script must find exactly the same."""
    # The agent's own: a key in its environment, an env file and a key file in its state folder,
    # another team's checkpoint in its node cache.
    monkeypatch.setenv("FORGELINE_TEMPORAL_API_KEY", SECRET)
    agent_home = tmp_path / "agent-home"
    (agent_home / "keys").mkdir(parents=True)
    env_file = agent_home / "agent.env"
    env_file.write_text(f"FORGELINE_TEMPORAL_API_KEY={SECRET}\n")
    (agent_home / "keys" / "tls.key").write_text(SECRET)
    cache = agent_home / "cache"
    theirs = cache / "checkpoints" / "runs" / "team-b-run" / "model.safetensors"
    theirs.parent.mkdir(parents=True)
    theirs.write_text("team b's weights")
    cached_code = cache / "code" / "snap"
    cached_code.mkdir(parents=True)

    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    theirs_key = "runs/team-b-run/checkpoints/step-10/gen-1/MANIFEST.json"
    trainer.store.put_bytes(theirs_key, b"team b's manifest")
    code = tmp_path / "run" / "code"
    code.mkdir(parents=True)
    (code / "train.py").write_text(HOSTILE)
    planted = code / "tqdm.py"
    probe = {
        "secret": SECRET,
        "read": [str(env_file), str(agent_home / "keys" / "tls.key"), str(theirs)],
        "write": [str(planted), str(theirs), str(cached_code / "tqdm.py")],
        "door": f"{BOX_DOOR}/{DOOR_SOCKET}",
        "agent_home": str(agent_home),
        "theirs": theirs_key,
        "fence": "runs/team-a-run/generations/gen-1.json",
        "other_gen": "runs/team-a-run/checkpoints/step-4/gen-2/MANIFEST.json",
        "mine": "runs/team-a-run/checkpoints/step-4/gen-1/notes.txt",
    }
    (code / "probe.json").write_text(json.dumps(probe))

    train = TrainSpec(steps=2, batch_size=4, code="code", entrypoint="train.py")
    job = trainer.job("team-a-run", train, code_dir=str(code))
    workdir = Path(job.progress_file).parent
    folder = door_folder(tmp_path / "node", "team-a-run")
    job.store_url = door_url()
    box = rank_box(job, workdir, cache / "checkpoints" / "runs" / "team-a-run", folder)
    rdzv = Rendezvous(f"127.0.0.1:{free_port()}", "team-a-run-g1", 1, 2)
    policy = DoorPolicy(
        "team-a-run", 1, workdir, readable=(f"datasets/{trainer.snapshot.snapshot_id}/",)
    )

    standby: list[int | None] = []
    caplog.set_level(logging.INFO, logger="trainer.warm_launch")

    async def main() -> None:
        launcher = WarmLauncher(tmp_path / "standby") if start == "warm" else None
        if launcher is not None:
            await launcher.prepare(standby_box())
            standby.append(launcher.pid)
        # The script never trains: its run fails as the user's error, after it looked around.
        try:
            with (
                StoreDoor(trainer.store, policy, folder / DOOR_SOCKET),
                pytest.raises(UserCodeFailed, match="returned without training"),
            ):
                await run_ranks(job, workdir, rdzv, lambda _: None, box=box, launcher=launcher)
        finally:
            if launcher is not None:
                await launcher.close()

    request.addfinalizer(lambda: shutil.rmtree(folder, ignore_errors=True))
    # The host's /tmp is not the box's: a file there is not seen inside.
    marker = Path(f"/tmp/host-only-{os.getpid()}")
    marker.write_text(SECRET)
    try:
        asyncio.run(main())
    finally:
        marker.unlink()
    found = json.loads((workdir / "found-0.json").read_text())
    if start == "warm":  # the standby became the job's torchrun, in the job's box
        assert f"starts on the warm standby (pid {standby[0]})" in caplog.text, caplog.text
    other = json.loads((workdir / "found-1.json").read_text())  # the second rank found the same
    verdicts = {name: said[0] for name, said in found["door"].items()}
    assert {name: said[0] for name, said in other["door"].items()} == verdicts
    assert found["uid"] == 61000
    # Its own pid namespace: the box's init, torchrun, two ranks and their log copies; never
    # this process (the agent), whose environ holds the key.
    assert os.getpid() not in found["pids"] and len(found["pids"]) <= 8, found["pids"]
    assert found["secret_in"] == [] and not found["env_has_secret"]  # nor the store's key
    assert set(found["read"].values()) == {"FileNotFoundError"}, found["read"]
    # The code is read-only (nothing planted for the next run); the cache is not there at all.
    assert found["wrote"][str(planted)] == "OSError"
    assert found["wrote"][str(theirs)] == found["wrote"][str(cached_code / "tqdm.py")]
    assert found["wrote"][str(theirs)] in ("FileNotFoundError", "PermissionError", "OSError")
    assert not planted.exists() and not (cached_code / "tqdm.py").exists()
    assert theirs.read_text() == "team b's weights"
    assert marker.name not in found["tmp"]
    # What a GPU node's ranks need (trainer.device_env): CUDA left alone until a rank forks, the
    # flight recorder's dumps beside the job, the compile cache the run's own and writable.
    assert found["cuda_env"] == {
        "PYTORCH_NVML_BASED_CUDA_CHECK": "1",
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(workdir / "nccl-trace-rank-"),
        "TORCHINDUCTOR_CACHE_DIR": str(workdir / "compile-cache" / "inductor"),
        "TRITON_CACHE_DIR": str(workdir / "compile-cache" / "triton"),
    }
    assert (workdir / "compile-cache" / "inductor" / "kernel-1").read_text() == "compiled"
    # Its door: its own keys of its own generation, nothing else, and no file from outside its
    # run's folder (the agent opens the path, and would otherwise upload its own secrets).
    door = found["door"]
    assert door.pop("write its own") == ["ok", None] and door.pop("read its own") == ["ok", "mine"]
    assert {verdict for verdict, _ in door.values()} == {"DoorRefused"}, door
    assert "may list only its own keys" in door["list all runs"][1]
    assert "may read only its own keys" in door["read theirs"][1]
    assert "writes only keys of its own generation" in door["write another generation"][1]
    assert "uploads come only from the run's own folder" in door["upload through a link"][1]
    assert trainer.store.get_bytes(theirs_key) == b"team b's manifest"
    assert not trainer.store.exists("runs/team-a-run/generations/gen-1.json")


def test_the_unconfined_flag_takes_only_its_explicit_form() -> None:
    with pytest.raises(UnconfinedFormError, match=UNCONFINED_FORM):
        decide("yes")
    with pytest.raises(UnconfinedFormError):
        decide("")
    unconfined = decide(UNCONFINED_FORM)
    assert unconfined.mode is Confinement.UNCONFINED
    assert unconfined.describe().startswith("unconfined: ")
    assert decide(None).mode is Confinement.BOX  # bwrap is here


def test_a_host_without_bwrap_refuses_user_code_saying_why(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    refused = decide(None)
    assert refused.mode is Confinement.REFUSED
    assert "bwrap is not installed" in refused.why and "apt-get install bubblewrap" in refused.why


# Each rank says which GPUs it was told it has and which GPU files it can open.
SAYS_ITS_GPUS = returns_when_every_rank_wrote(
    """
    import json, os, pathlib
    seen = {"visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "files": sorted(n for n in os.listdir("/dev") if n.startswith("nvidia"))}
    out = pathlib.Path(os.environ["FORGELINE_JOB"]).with_name(f"gpus-{os.environ['RANK']}.json")
    out.write_text(json.dumps(seen))
    """
)


def test_two_four_gpu_jobs_packed_on_an_eight_gpu_node_never_see_the_same_gpu(
    trainer: Trainer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The scheduler grants two 4-GPU jobs one 8-GPU node; each job's four ranks are told of
    and can open only the GPUs its grant names (here: stand-in device files, as on a node
    whose NVML numbers each GPU's file by its index)."""
    devices = tmp_path / "dev"
    devices.mkdir()
    for name in [*(f"nvidia{i}" for i in range(8)), "nvidiactl"]:
        os.mknod(devices / name, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    monkeypatch.setattr(sandbox, "DEVICE_ROOT", str(devices))
    state = ClusterState(config=ClusterConfig(spare_nodes=0), nodes=[node("n0")])
    state.queue = [request("job-a", gpus_per_node=4), request("job-b", gpus_per_node=4)]
    run_pass(state, NOW, TODAY)
    grants = {a.run_id: a.devices_on("n0") for a in state.allocations}

    async def run(run_id: str) -> Path:
        code = tmp_path / run_id / "code"
        code.mkdir(parents=True)
        (code / "train.py").write_text(SAYS_ITS_GPUS)
        train = TrainSpec(steps=1, batch_size=4, code="code", entrypoint="train.py")
        job = trainer.job(run_id, train, code_dir=str(code))
        workdir = Path(job.progress_file).parent
        box = rank_box(job, workdir, tmp_path / run_id / "own", None, tuple(grants[run_id]))
        rdzv = Rendezvous(f"127.0.0.1:{free_port()}", f"{run_id}-g1", 1, 4)
        with pytest.raises(UserCodeFailed, match="returned without training"):
            await run_ranks(
                job,
                workdir,
                rdzv,
                lambda _: None,
                box=box,
                devices=GrantedDevices(grants[run_id], cuda=False),
            )
        return workdir

    async def both() -> list[Path]:
        return await asyncio.gather(run("job-a"), run("job-b"))

    seen = {}
    for workdir in asyncio.run(both()):
        ranks = [json.loads((workdir / f"gpus-{r}.json").read_text()) for r in range(4)]
        assert all(rank == ranks[0] for rank in ranks)  # a job's ranks share its GPUs
        seen[workdir] = ranks[0]
    a, b = seen.values()
    assert {a["visible"], b["visible"]} == {"0,1,2,3", "4,5,6,7"}
    for said in (a, b):
        own = [f"nvidia{i}" for i in said["visible"].split(",")]
        assert said["files"] == sorted([*own, "nvidiactl"])
