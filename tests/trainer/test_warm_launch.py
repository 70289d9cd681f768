"""A node agent's standby torchrun (trainer.warm_launch): it becomes the next job's torchrun,
real ranks train under it, and a standby that died costs only a cold start."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest

from activities.node import NodeActivities
from infra.processes import free_port
from infra.settings import SettingsError, load_settings
from tests.trainer.conftest import Trainer
from trainer.launch import RANK_SCRIPT, Rendezvous, run_ranks
from trainer.warm_launch import LaunchOrder, WarmLauncher
from workflows.contracts.spec import TrainSpec

TRAIN = TrainSpec(steps=6, batch_size=4, log_every=1, checkpoint_every=6, warmup_steps=1)


def children_running_ranks(parent: int) -> set[int]:
    pids = set()
    for proc in Path("/proc").iterdir():
        try:
            stat = (proc / "stat").read_text().rsplit(")", 1)[1].split()
            argv = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if int(stat[1]) == parent and RANK_SCRIPT.encode() in argv:
            pids.add(int(proc.name))
    return pids


# With the slow tests, to keep `make test` within 15 minutes (10 s): every job of the e2e
# stack in `make test` starts on its node's standby; a dead standby's cold start is here.
@pytest.mark.slow
def test_the_standby_becomes_torchrun_and_a_dead_one_costs_a_cold_start(
    trainer: Trainer, tmp_path: Path
) -> None:
    async def run(launcher: WarmLauncher, run_id: str, watch: int | None) -> tuple[int, set[int]]:
        job = trainer.job(run_id, TRAIN)
        workdir = Path(job.progress_file).parent
        rdzv = Rendezvous(f"127.0.0.1:{free_port()}", run_id, 1, 1)
        ranks: set[int] = set()

        async def observe() -> None:
            # Every 20 ms, not at the progress reports: a job of six short steps can run between
            # two reports.
            while watch is not None:
                ranks.update(children_running_ranks(watch))
                await asyncio.sleep(0.02)

        watching = asyncio.create_task(observe())
        try:
            tail = await run_ranks(
                job, workdir, rdzv, on_progress=lambda _: None, launcher=launcher
            )
        finally:
            watching.cancel()
        assert tail.finished and tail.latest["step"] == TRAIN.steps, tail.latest
        # The ranks' output went to the job's log, as with a cold start.
        assert f"step {TRAIN.steps}/{TRAIN.steps}" in (workdir / "torchrun.log").read_text()
        return tail.latest["step"], ranks

    async def main() -> None:
        launcher = WarmLauncher(tmp_path / "standby")
        await launcher.prepare()
        standby = launcher.pid
        assert standby is not None
        _, ranks = await run(launcher, "warm-1", standby)
        assert ranks, "no rank ran under the standby: it did not become torchrun"
        # Once the ranks trained, the next standby was made; it dies before the next job.
        assert launcher.ready and launcher.pid not in (None, standby)
        os.kill(launcher.pid, signal.SIGKILL)
        await asyncio.sleep(0.5)
        step, _ = await run(launcher, "warm-2", None)
        assert step == TRAIN.steps
        await launcher.close()

    asyncio.run(main())


def test_a_node_agent_keeps_a_standby_unless_the_setting_says_not(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("FORGELINE_HOME", str(tmp_path))
    monkeypatch.delenv("FORGELINE_NODE_WARM_STANDBY", raising=False)
    assert NodeActivities(load_settings(), "n0").launcher is not None
    monkeypatch.setenv("FORGELINE_NODE_WARM_STANDBY", "false")
    assert NodeActivities(load_settings(), "n0").launcher is None
    monkeypatch.setenv("FORGELINE_NODE_WARM_STANDBY", "maybe")
    with pytest.raises(SettingsError, match="FORGELINE_NODE_WARM_STANDBY='maybe' is not a yes/no"):
        load_settings()


def test_a_standby_made_before_the_code_changed_is_not_used(tmp_path: Path) -> None:
    """An upgrade in place: the standby imported the old code, so the job starts cold."""
    code = tmp_path / "code"
    code.mkdir()
    module = code / "module.py"
    module.write_text("VERSION = 1\n")

    async def main() -> tuple[int | None, bool]:
        launcher = WarmLauncher(tmp_path / "standby", code_roots=(code,))
        await launcher.prepare()
        standby = launcher.pid
        module.write_text("VERSION = 22\n")  # another size: changed however coarse the clock
        order = LaunchOrder(args=[], env={}, cwd=str(tmp_path), log_file=str(tmp_path / "log"))
        started = await launcher.start(order)
        return standby, started is None and not launcher.ready

    standby, cold = asyncio.run(main())
    assert standby is not None and cold
    # The standby it did not use is gone (killed and reaped), not left waiting.
    assert not Path(f"/proc/{standby}").exists()
