"""A run with requirements runs its ranks in its own environment (issue 46, part 4), through the
real launch path: torchrun started cold with the environment's Python (a warm standby, made
with the node's, waits on for the next job), in the rank box where the host has bwrap, the
environment read-only in it. The rank imports the package from the environment and torch from
the node."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest
import torch

from activities.fetch import NodeCache
from infra.processes import free_port
from infra.store.local import LocalStore
from tests.trainer.conftest import Trainer, returns_when_every_rank_wrote
from trainer.errors import UserCodeFailed
from trainer.launch import Rendezvous, run_ranks
from trainer.rank_box import rank_box, standby_box
from trainer.warm_launch import WarmLauncher
from workflows.contracts.spec import TrainSpec

# What the rank sees, written beside its job file; then it returns without training (the run
# fails as the user's error, which is all this script needs of it).
LOOKS = returns_when_every_rank_wrote(
    """
    import json, os, pathlib, sys
    import tomli_w, torch

    env = pathlib.Path(os.environ["VIRTUAL_ENV"])
    try:
        (env / "planted.py").write_text("x = 1")
        writable = True
    except OSError:
        writable = False
    seen = {"package": tomli_w.__file__, "prefix": sys.prefix, "torch": torch.__file__,
            "env": str(env), "env_writable": writable}
    out = pathlib.Path(os.environ["FORGELINE_JOB"]).with_name(f"seen-{os.environ['RANK']}.json")
    out.write_text(json.dumps(seen))
    """
)


def test_a_rank_imports_its_package_from_its_environment(trainer: Trainer, tmp_path: Path) -> None:
    code = tmp_path / "code"
    code.mkdir()
    (code / "train.py").write_text(LOOKS)
    (code / "requirements.txt").write_text("tomli-w==1.0.0\n")
    cache = NodeCache(tmp_path / "cache", LocalStore(tmp_path / "store"), 10**10)
    boxed = shutil.which("bwrap") is not None

    job = trainer.job(
        "env-run",
        TrainSpec(steps=2, batch_size=4, code="code", entrypoint="train.py"),
        code_dir=str(code),
    )
    workdir = Path(job.progress_file).parent
    rdzv = Rendezvous(f"127.0.0.1:{free_port()}", "env-run-g1", 1, 2)

    async def main() -> int | None:
        launcher = WarmLauncher(tmp_path / "standby")
        await launcher.prepare(standby_box() if boxed else None)
        waiting = launcher.pid
        try:
            with cache.lease() as lease:
                env = lease.environment(code)
                assert env is not None
                box = (
                    rank_box(job, workdir, tmp_path / "own", None, (), python_env=env.folder)
                    if boxed
                    else None
                )
                with pytest.raises(UserCodeFailed, match="returned without training"):
                    await run_ranks(
                        job, workdir, rdzv, lambda _: None, launcher=launcher, box=box,
                        python_env=env,
                    )  # fmt: skip
            # The standby was not handed this job: it waits for the next, as it was.
            assert launcher.pid == waiting
            return waiting
        finally:
            await launcher.close()

    assert asyncio.run(main()) is not None
    env_folder = next((tmp_path / "cache" / "envs").glob("[0-9a-f]*"))
    for rank in (0, 1):
        seen = json.loads((workdir / f"seen-{rank}.json").read_text())
        assert seen["prefix"] == seen["env"] == str(env_folder)
        assert seen["package"].startswith(str(env_folder))
        assert seen["torch"] == torch.__file__  # the node's
        if boxed:  # shared by every run that declares the same: nobody's to change
            assert seen["env_writable"] is False
            assert not (env_folder / "planted.py").exists()
